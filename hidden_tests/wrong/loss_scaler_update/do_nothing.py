"""Does nothing: the scale and the count never change.
max share: 0
"""
### BEGIN YOUR CODE assignment=loss_scaler_update
pass
### END YOUR CODE
