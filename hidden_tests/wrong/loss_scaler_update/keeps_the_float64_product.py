"""Keeps the float64 product as the scale (no rounding to float32), and grows only while it stays under the float32 maximum.
max share: 0.34
"""
### BEGIN YOUR CODE assignment=loss_scaler_update
if bool(found_inf):
    self.scale = self.scale * self.backoff_factor
    self.growth_tracker = 0
    return
self.growth_tracker += 1
if self.growth_tracker == self.growth_interval:
    grown = self.scale * self.growth_factor
    if grown <= np.finfo(np.float32).max:
        self.scale = grown
    self.growth_tracker = 0
### END YOUR CODE
