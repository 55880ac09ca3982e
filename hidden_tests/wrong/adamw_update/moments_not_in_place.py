"""Rebinds exp_avg and exp_avg_sq to new arrays: the optimizer's moments never change, so every step is a first step.
max share: 0.11
"""
### BEGIN YOUR CODE assignment=adamw_update
beta1, beta2 = betas
param -= lr * weight_decay * param
exp_avg = beta1 * exp_avg + (1.0 - beta1) * grad
exp_avg_sq = beta2 * exp_avg_sq + (1.0 - beta2) * grad * grad
m_hat = exp_avg / (1.0 - beta1**step)
v_hat = exp_avg_sq / (1.0 - beta2**step)
param -= lr * m_hat / (np.sqrt(v_hat) + eps)
### END YOUR CODE
