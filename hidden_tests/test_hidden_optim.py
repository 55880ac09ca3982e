"""Hidden checks of AdamW's update (chapter 1): other betas, no weight decay, several steps, in float64."""
import numpy as np

from minidist.core.optim import adamw_update


def test_three_steps_against_the_equations_written_out():
    rng = np.random.default_rng(7)
    p, m, v = rng.standard_normal(5), np.zeros(5), np.zeros(5)
    want, mw, vw = p.copy(), np.zeros(5), np.zeros(5)
    b1, b2, lr, eps, wd = 0.5, 0.75, 0.1, 1e-6, 0.02
    for t in (1, 2, 3):
        g = rng.standard_normal(5)
        adamw_update(p, g, m, v, t, lr, (b1, b2), eps, wd)
        want = want - lr * wd * want
        mw, vw = b1 * mw + (1 - b1) * g, b2 * vw + (1 - b2) * g * g
        want = want - lr * (mw / (1 - b1**t)) / (np.sqrt(vw / (1 - b2**t)) + eps)
    np.testing.assert_allclose(p, want, rtol=1e-13)
    np.testing.assert_allclose(m, mw, rtol=1e-13)
    np.testing.assert_allclose(v, vw, rtol=1e-13)
