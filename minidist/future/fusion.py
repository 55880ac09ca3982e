"""What fusing memory-bound operations saves: the bytes of bias + GeLU + dropout (chapter 11).

After the MLP's first matrix product (`MLP.forward` in minidist/core/model.py) come three
element-wise operations on its (b, s, 4h) output x: add the bias, GeLU, dropout. Each does a
few arithmetic operations per element and, run one at a time (as NumPy, or PyTorch's eager
mode, runs them), reads its input from memory and writes its output back. A GPU does some 300
FLOPs in the time it moves one byte, so these operations take as long as their bytes take.
A compiler (torch.compile, XLA) or a hand-written kernel (Megatron-LM's bias-GeLU) fuses the
chain into one pass: read x once, write the result once, keep the intermediates in registers.

The ledger below counts, per element of x, the arrays each pass reads and writes (e bytes per
element, m per dropout-mask element; the bias is 4h numbers, nothing beside b s 4h):

    unfused forward    add: read x, write y     GeLU: read y, write z     dropout: read z, write mask, out
    unfused backward   dropout: read g, mask, write g_z    GeLU: read g_z, y, write g_y
                       bias: read g_y (its gradient sums g_y over the rows; g_y goes on as g_x)
    fused forward      read x, write mask, out               (y is recomputed in backward)
    fused backward     read g, mask, x, write g_x            (the bias gradient in the same pass)

    unfused: (12 e + 2 m) bytes per element,   fused: (5 e + 2 m)

Both keep the same for backward (y or x, and the mask), so fusing saves time, not memory. This
is a ledger, not a measurement: NumPy cannot fuse, so minidist runs the unfused chain.
"""
from __future__ import annotations

# (pass, arrays read, arrays written); "mask" is the dropout mask, every other array has e bytes per element
UNFUSED = {
    "forward": [("bias add", ["x"], ["y"]), ("GeLU", ["y"], ["z"]), ("dropout", ["z"], ["mask", "out"])],
    "backward": [("dropout", ["g", "mask"], ["g_z"]), ("GeLU", ["g_z", "y"], ["g_y"]), ("bias", ["g_y"], [])],
}
FUSED = {
    "forward": [("bias + GeLU + dropout", ["x"], ["mask", "out"])],
    "backward": [("bias + GeLU + dropout", ["g", "mask", "x"], ["g_x"])],
}


def chain_bytes(elements: int, itemsize: int, mask_itemsize: int, fused: bool) -> dict:
    """Bytes moved to and from memory by the chain on `elements` elements: per pass, forward,
    backward and total."""
    ledger = FUSED if fused else UNFUSED
    out = {"passes": []}
    for direction, passes in ledger.items():
        moved = 0
        for name, reads, writes in passes:
            nbytes = sum(elements * (mask_itemsize if a == "mask" else itemsize) for a in reads + writes)
            out["passes"].append((direction, name, nbytes))
            moved += nbytes
        out[direction] = moved
    out["total"] = out["forward"] + out["backward"]
    return out


def mlp_elements(batch: int, seq: int, width: int) -> int:
    """Elements of the MLP's hidden activation, b s 4h: what the chain runs over."""
    return batch * seq * 4 * width
