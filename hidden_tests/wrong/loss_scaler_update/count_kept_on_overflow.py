"""Backs off on an overflow but keeps the count of clean steps: the next growth comes too early.
max share: 0.27
"""
### BEGIN YOUR CODE assignment=loss_scaler_update
if bool(found_inf):
    self.scale = _fp32(self.scale * self.backoff_factor)
    return
successful = self.growth_tracker + 1
if successful == self.growth_interval:
    grown = _fp32(self.scale * self.growth_factor)
    if np.isfinite(grown):
        self.scale = grown
    self.growth_tracker = 0
else:
    self.growth_tracker = successful
### END YOUR CODE
