"""A small decoder-only transformer (GPT-style: pre-norm blocks, causal attention, tied embeddings), and its
tensor-parallel plan (Megatron-style: attention heads and the MLP's hidden units split over the group, sequence
parallelism on the norms and the residual stream, vocabulary-split embeddings and head)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from runconfig.schema import ModelConfig
from trainer.data.documents import document_ids, document_mask, document_positions
from trainer.recipes.api import positions as sequence_positions


class Attention(nn.Module):
    """Causal self-attention. ``q``, ``k`` and ``v`` are separate layers, so that tensor parallelism can split each
    by heads (a fused [3d, d] matrix split in rows would hand a rank parts of q, k and v of different heads);
    without it they run as one fused matrix product, as fast as a fused layer and bit-identical to one."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.d_model // cfg.n_heads
        self.q = nn.Linear(cfg.d_model, cfg.d_model)
        self.k = nn.Linear(cfg.d_model, cfg.d_model)
        self.v = nn.Linear(cfg.d_model, cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor, doc: torch.Tensor | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        if _is_dtensor(self.q.weight):  # tensor-parallel: each layer's hooks hand back this rank's heads
            q, k, v = self.q(x), self.k(x), self.v(x)
        else:
            weight = torch.cat([self.q.weight, self.k.weight, self.v.weight])
            q, k, v = F.linear(x, weight, torch.cat([self.q.bias, self.k.bias, self.v.bias])).chunk(3, dim=-1)
        q, k, v = (z.view(b, t, -1, self.head_dim).transpose(1, 2) for z in (q, k, v))
        dropout = self.dropout if self.training else 0.0
        if doc is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)
        else:  # model.doc_mask: causal within each document only
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(doc), dropout_p=dropout)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model),
            nn.GELU(),
            nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model),
        )
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, doc: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x), doc=doc))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    """With ``eos`` (model.doc_mask: the dataset's end-of-document id), attention and positions stay inside each
    document of a packed window (trainer/data/documents.py)."""

    def __init__(self, cfg: ModelConfig, eos: int | None = None) -> None:
        super().__init__()
        self.cfg, self.eos = cfg, eos
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head.weight = self.tok.weight  # tied
        self.apply(self._init)
        for name, p in self.named_parameters():
            self._residual_init(name, p)

    def init_weights(self, path: str, module: nn.Module) -> None:
        """One module's own parameters, as the constructor initialises them (``Recipe.init_weights`` for
        ``parallel.meta_init``; ``path`` names the module in this model)."""
        self._init(module)
        for name, p in module.named_parameters(recurse=False):
            self._residual_init(f"{path}.{name}" if path else name, p)
        if isinstance(module, nn.LayerNorm):
            module.reset_parameters()

    def _residual_init(self, name: str, p: nn.Parameter) -> None:
        """Scaled init of the residual projections (GPT-2): ``name`` is the parameter's name in this model."""
        if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
            nn.init.normal_(p, std=0.02 / math.sqrt(2 * self.cfg.n_layers))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if self.eos is None:
            doc, positions = None, sequence_positions(idx.shape[1], idx.device)
        else:
            doc, positions = document_ids(idx, self.eos), document_positions(idx, self.eos)
        x = self.drop(self.tok(idx) + self.pos(positions))
        for block in self.blocks:
            x = block(x) if doc is None else block(x, doc=doc)
        return self.head(self.ln_f(x))


class Stage(nn.Module):
    """Pipeline stage ``stage`` of ``stages``: a contiguous run of blocks (split as evenly as the layers allow), the
    embeddings on the first stage, the final norm and the head on the last. Parameter names are the whole model's
    (blocks keyed by their index)."""

    def __init__(self, model: GPT, stage: int, stages: int) -> None:
        super().__init__()
        n = len(model.blocks)
        lo, hi = n * stage // stages, n * (stage + 1) // stages
        self.first, self.last = stage == 0, stage == stages - 1
        if self.first:
            self.tok, self.pos, self.drop = model.tok, model.pos, model.drop
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in range(lo, hi)})
        if self.last:
            self.ln_f, self.head = model.ln_f, model.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.drop(self.tok(x) + self.pos(sequence_positions(x.shape[1], x.device)))
        for block in self.blocks.values():
            x = block(x)
        return self.head(self.ln_f(x)) if self.last else x


def next_tokens(batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of token windows -> (the model's input, the next token of each position): window[:, :-1], [:, 1:]."""
    return batch[:, :-1], batch[:, 1:]


def pipeline():
    """The GPT as a pipeline (``Recipe.pipeline``): stages of consecutive blocks; batches are token windows."""
    from trainer.recipes.api import Pipeline

    return Pipeline(stage=Stage, split=next_tokens, loss=loss_fn)


def context_parallel():
    """The GPT with its sequences split over ranks (``Recipe.context_parallel``): the window's input and targets."""
    from trainer.recipes.api import ContextParallel

    return ContextParallel(split=next_tokens, loss=loss_fn)


def tp_plan(model: nn.Module) -> dict:
    """The tensor-parallel plan (``parallelize_module``), as torchtitan's for Llama: the residual stream is split
    by sequence between blocks (norms and dropout on 1/tp of the tokens), gathered before attention and the MLP,
    whose first layers are split by output (heads, hidden units) and whose last layers by input, reduce-scattered
    back to the sequence split. The embeddings and the tied head are split by vocabulary rows; the logits are
    gathered whole for the loss (under parallel.loss_parallel the trainer keeps them split instead). Needs n_heads
    and mlp_ratio x d_model divisible by the degree."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    gather = {"input_layouts": (Shard(1),), "desired_input_layouts": (Replicate(),)}
    plan: dict = {}
    if hasattr(model, "tok"):  # the whole model, or the first pipeline stage (Stage): a later stage's input is
        # the previous stage's output, already split by sequence
        first = next(iter(model.blocks.keys())) if isinstance(model.blocks, nn.ModuleDict) else "0"
        plan |= {
            "tok": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "pos": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            f"blocks.{first}": PrepareModuleInput(
                input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True
            ),
        }
    plan |= {
        "blocks.*.ln1": SequenceParallel(),
        "blocks.*.attn": PrepareModuleInput(**gather),
        "blocks.*.attn.q": ColwiseParallel(),
        "blocks.*.attn.k": ColwiseParallel(),
        "blocks.*.attn.v": ColwiseParallel(),
        "blocks.*.attn.proj": RowwiseParallel(output_layouts=Shard(1)),
        "blocks.*.ln2": SequenceParallel(),
        "blocks.*.mlp": PrepareModuleInput(**gather),
        "blocks.*.mlp.0": ColwiseParallel(),
        "blocks.*.mlp.2": RowwiseParallel(output_layouts=Shard(1)),
    }
    if hasattr(model, "head"):  # the whole model, or the last pipeline stage
        plan |= {
            "ln_f": SequenceParallel(),
            "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        }
    return plan


def loss_fn(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1), reduction=reduction)


def flops_per_token(model: GPT) -> float:
    """Training FLOPs per token: 6 N (forward 2 N + backward 4 N over the matmul weights: attention projections,
    MLP and the output head; embedding lookups are not matmuls) plus 12 L d T for the attention scores and their
    weighted sum (forward 4 L d T for QK^T and AV, times 3 with the backward pass). The PaLM paper's formula
    (appendix B), without activation recomputation."""
    cfg = model.cfg
    matmul = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    return 6.0 * matmul + 12.0 * cfg.n_layers * cfg.d_model * cfg.seq_len
