"""The demo GPT written in PyTorch, only as a yardstick for `python -m minidist.bench step`.

Same architecture as minidist/core/model.py (separate q/k/v projections, pre-LayerNorm, tanh GELU,
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


class TorchTrainer:
    """The same model in PyTorch, as a trainer with `step(s)` for `python -m minidist.bench dp
    --torch`: one process on the whole batch ("torch-serial"), or torch's DistributedDataParallel
    over the gloo backend on this rank's B/N rows ("torch-ddp"). Random tokens: only time counts."""

    def __init__(self, config, batch_size, dtype, ddp=False):
        torch.set_num_threads(1)  # one core per rank, as minidist's ranks
        torch_dtype = {"float32": torch.float32, "float64": torch.float64}[dtype]
        torch.manual_seed(0)
        model = _GPT(config).to(torch_dtype)
        self.model = model
        self.net = nn.parallel.DistributedDataParallel(model) if ddp else model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
        self.x = torch.randint(0, config.vocab_size, (batch_size, config.block_size))
        self.y = torch.randint(0, config.vocab_size, (batch_size, config.block_size))

    def step(self, s):
        loss = self.net(self.x, self.y)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()  # torch DDP: bucketed all-reduces overlap backward, waited for at its end
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        return loss.item()


def init_gloo(comm) -> None:
    """torch.distributed over gloo on the ranks of an MPI communicator: rank 0 picks a free port
    and tells the others through MPI."""
    import socket

    import torch.distributed as torch_dist

    if torch_dist.is_initialized():
        return
    port = None
    if comm.rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = comm.bcast(port, root=0)
    torch_dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=comm.rank,
                                  world_size=comm.size)
