"""The `--megatron` body of `train_gpt`: the same training with megatron-core's GPTModel.

    python -m taco_triton.examples.train_gpt --megatron --tp 2 --compress none,fp8 --steps 300

Each spawned rank initializes megatron's parallel state (tensor_model_parallel_size = --tp),
builds a GPTModel with the local layer spec (byte vocabulary 256, --layers/--hidden/--heads/--ffn,
max sequence --seq, learned absolute positions, no dropout), and trains it on the same batches
as `train_gpt` with AdamW on FP32 master weights. `taco_triton.integrations.megatron.enable`
routes megatron's TP communication through taco_triton under the mode's policy (`make_policy`),
in every mode: mode "none" is enabled with ``CompressionPolicy(default=None)``, so every routed
collective runs the native one (megatron's own numerics) and is still counted by
`taco.WireStats` like the compressed modes.

Precision: megatron's TP collectives communicate the activations' dtype (the integration does
not apply the policy's ``comm_dtype``), so to keep the baseline bf16 as in `train_gpt`, the
model always computes in bf16 (``TransformerConfig(bf16=True)``, softmax in FP32) on FP32 master
weights, as megatron's mixed precision does; ``--compute-dtype`` does not apply here.

Not routed (so not in wire_bytes in any mode): the three small FP32 all-reduces of
``vocab_parallel_cross_entropy``. Sequence parallelism is not supported here (megatron's torch
LayerNorm wrapper refuses it on CPU).
"""
from __future__ import annotations

import os
import time

import torch

import taco_triton as taco

VOCAB = 256


def _config(args, world):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
        ffn_hidden_size=args.ffn, tensor_model_parallel_size=world,
        use_cpu_initialization=True, gradient_accumulation_fusion=False, params_dtype=torch.float32,
        bf16=True, masked_softmax_fusion=False, attention_softmax_in_fp32=True,
        hidden_dropout=0.0, attention_dropout=0.0,
    )


def train_rank_megatron(rank: int, world: int, mode: str, args, device: torch.device) -> list[dict]:
    """Train one mode on this rank (the process group is up); returns the logged rows."""
    if args.sequence_parallel:
        raise ValueError("--megatron does not support --sequence-parallel (torch LayerNorm on CPU)")
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    from taco_triton.integrations import megatron as tm

    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from taco_triton.examples.data import TextBatches, stdlib_bytes
    from taco_triton.examples.train_gpt import make_policy

    with tm.cpu_compat():
        ps.initialize_model_parallel(tensor_model_parallel_size=world)
        handle = None
        try:
            model_parallel_cuda_manual_seed(args.seed, inference_rng_tracker=True)
            torch.manual_seed(args.seed)  # the same full weights in every mode
            model = GPTModel(config=_config(args, world), transformer_layer_spec=get_gpt_layer_local_spec(),
                             vocab_size=VOCAB, max_sequence_length=args.seq).to(device)
            params = [p for p in model.parameters() if p.requires_grad]
            master = [p.detach().clone().float().requires_grad_(True) for p in params]
            model.to(torch.bfloat16)  # bf16 compute and communication on FP32 master weights
            opt = torch.optim.AdamW(master, lr=args.lr, weight_decay=0.01)
            policy = make_policy(mode, args)
            handle = tm.enable(policy, model=model)

            data = TextBatches(stdlib_bytes(args.data_bytes), args.seq)
            gen = torch.Generator().manual_seed(args.seed + 1)  # every rank of the TP group sees the same batch
            pos = torch.arange(args.seq, device=device)[None]
            mask = torch.triu(torch.ones(args.seq, args.seq, device=device), diagonal=1).bool()[None, None]

            def loss_of(x, y):  # per-token losses in FP32, identical on every TP rank
                return model(x, pos.expand_as(x), mask, labels=y).float().mean()

            def evaluate():
                g = torch.Generator().manual_seed(args.seed + 2)  # the same validation batches every time
                model.eval()
                with torch.no_grad():
                    losses = [float(loss_of(*(t.to(device) for t in data.batch("val", args.batch, g))))
                              for _ in range(args.eval_batches)]
                model.train()
                return sum(losses) / len(losses)

            rows = []
            for step in range(1, args.steps + 1):
                x, y = (t.to(device) for t in data.batch("train", args.batch, gen))
                t0 = time.perf_counter()
                with taco.WireStats() as ws:
                    loss = loss_of(x, y)
                    loss.backward()
                for m, p in zip(master, params):
                    m.grad = p.grad.float() if p.grad is not None else None
                    p.grad = None
                opt.step()
                opt.zero_grad(set_to_none=True)
                with torch.no_grad():
                    for m, p in zip(master, params):
                        p.copy_(m)
                policy.step()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                dt = time.perf_counter() - t0
                row = {"mode": mode, "step": step, "train_loss": float(loss.detach()), "wire_bytes": ws.wire_bytes,
                       "compressed_calls": sum(c.compressed for c in ws.calls), "step_ms": 1e3 * dt,
                       "val_loss": float("nan")}
                if step % args.eval_every == 0 or step == args.steps:
                    row["val_loss"] = evaluate()
                rows.append(row)
                if rank == 0 and args.verbose and (step % args.eval_every == 0 or step == args.steps):
                    print(f"  [megatron {mode}] step {step:4d}  train {row['train_loss']:.4f}  "
                          f"val {row['val_loss']:.4f}  wire {row['wire_bytes'] / 2**20:.2f} MiB  "
                          f"{row['step_ms']:.0f} ms", flush=True)
            if rank == 0 and args.verbose:
                routed = sum(s.calls for s in handle.stats.values())
                compressed = sum(s.compressed for s in handle.stats.values())
                print(f"  [megatron {mode}] routed {routed} TP collectives at {len(handle.stats)} sites, "
                      f"{compressed} compressed", flush=True)
                if policy.frozen:
                    print(f"  [megatron {mode}] frozen plan: {len(policy.plan_dict())} sites, codecs "
                          f"{sorted({(c.codec, c.group_size, c.hadamard) for c in policy.plan_dict().values()})}")
            return rows
        finally:
            if handle is not None:
                handle.disable()
            ps.destroy_model_parallel()
