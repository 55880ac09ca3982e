"""The demo GPT written in PyTorch, only as a yardstick for `python -m minidist.bench step`.

Same architecture as minidist/model.py (separate q/k/v projections, pre-LayerNorm, tanh GELU,
tied head), eager mode, AdamW. Imported only when torch is installed.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F


class _Block(nn.Module):
    def __init__(self, c, n_head):
        super().__init__()
        self.n_head = n_head
        self.ln_1, self.ln_2 = nn.LayerNorm(c), nn.LayerNorm(c)
        self.q, self.k, self.v, self.proj = (nn.Linear(c, c) for _ in range(4))
        self.fc, self.fc_proj = nn.Linear(c, 4 * c), nn.Linear(4 * c, c)

    def forward(self, x):
        b, t, c = x.shape
        h = self.ln_1(x)
        q, k, v = (f(h).view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.fc_proj(F.gelu(self.fc(self.ln_2(x)), approximate="tanh"))


class _GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        c = config.n_embd
        self.wte, self.wpe = nn.Embedding(config.vocab_size, c), nn.Embedding(config.block_size, c)
        self.h = nn.ModuleList(_Block(c, config.n_head) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(c)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        logits = self.ln_f(x) @ self.wte.weight.T
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def make_torch_step(config, batch_size, dtype):
    torch_dtype = {"float32": torch.float32, "float64": torch.float64}[dtype]
    torch.manual_seed(0)
    model = _GPT(config).to(torch_dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, config.vocab_size, (batch_size, config.block_size))
    y = torch.randint(0, config.vocab_size, (batch_size, config.block_size))

    def step():
        loss = model(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return step
