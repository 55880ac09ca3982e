"""Grows whatever the product: past the largest float32 the scale becomes inf.
max share: 0.34
"""
### BEGIN YOUR CODE assignment=loss_scaler_update
if bool(found_inf):
    self.scale = _fp32(self.scale * self.backoff_factor)
    self.growth_tracker = 0
    return
successful = self.growth_tracker + 1
if successful == self.growth_interval:
    self.scale = _fp32(self.scale * self.growth_factor)
    self.growth_tracker = 0
else:
    self.growth_tracker = successful
### END YOUR CODE
