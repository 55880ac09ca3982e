"""Mixed precision (混合精度训练, chapter 10): the number formats and what training does with them.

    formats.py          fp32, bf16, fp16 and fp8 (e4m3, e5m2) as ml_dtypes arrays; rounding;
                        autocast's policy (which operation computes in which format)
    mixed_precision.py  fp32 master weights in AdamW, the 16-bit step, and `Precision`: the one
                        object every trainer holds for it (format, masters, scaler, step)
    loss_scale.py       the dynamic loss scaler (torch's GradScaler, bit for bit)
    fp8.py              fp8 matrix products with Transformer Engine's delayed scaling

The formats' names are the package's own: `from minidist.precision import autocast, FORMATS`.
"""
from minidist.precision.formats import (FORMATS, LOW_PRECISION, POLICY, Format, Policy,  # noqa: F401
                                        autocast, format_of, round_to)
