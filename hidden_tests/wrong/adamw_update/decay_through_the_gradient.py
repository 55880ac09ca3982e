"""Adds wd * p to the gradient (Adam's L2 penalty), so the decay goes through the moments: not AdamW.
max share: 0.22
"""
### BEGIN YOUR CODE assignment=adamw_update
beta1, beta2 = betas
grad = grad + weight_decay * param
exp_avg[...] = beta1 * exp_avg + (1.0 - beta1) * grad
exp_avg_sq[...] = beta2 * exp_avg_sq + (1.0 - beta2) * grad * grad
m_hat = exp_avg / (1.0 - beta1**step)
v_hat = exp_avg_sq / (1.0 - beta2**step)
param -= lr * m_hat / (np.sqrt(v_hat) + eps)
### END YOUR CODE
