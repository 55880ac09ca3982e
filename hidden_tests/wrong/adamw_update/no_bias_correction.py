"""Steps by the raw moments m / (sqrt(v) + eps): no bias correction, so the first steps are far too large.
max share: 0
"""
### BEGIN YOUR CODE assignment=adamw_update
beta1, beta2 = betas
param -= lr * weight_decay * param
exp_avg[...] = beta1 * exp_avg + (1.0 - beta1) * grad
exp_avg_sq[...] = beta2 * exp_avg_sq + (1.0 - beta2) * grad * grad
param -= lr * exp_avg / (np.sqrt(exp_avg_sq) + eps)
### END YOUR CODE
