"""Grows after growth_interval + 1 clean steps: it compares the count before adding this step.
max share: 0
"""
### BEGIN YOUR CODE assignment=loss_scaler_update
if bool(found_inf):
    self.scale = _fp32(self.scale * self.backoff_factor)
    self.growth_tracker = 0
    return
if self.growth_tracker == self.growth_interval:
    grown = _fp32(self.scale * self.growth_factor)
    if np.isfinite(grown):
        self.scale = grown
    self.growth_tracker = 0
else:
    self.growth_tracker += 1
### END YOUR CODE
