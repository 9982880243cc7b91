"""The q4 linear beside gemlite (PyPI, pure-Triton W4A16 GEMV / GEMM, HQQ packing) on our
shapes, on the GPU: the same 4-bit weights with a scale and an offset per 32 inputs (gemlite's
form: (q - zero) * scale, zero = -min / scale in fp16, its own packing), at each row count —
time (weights cold: each call reads the next of enough copies that none is in L2), bandwidth on
each one's own bytes, the error against a float64 reference, and the two properties fedserve
depends on: the same bits on a second run (determinism) and row 0's bits the same at m rows as
alone (batch invariance). Ours is the engine's dispatch (kernels/triton_linear.py), fp32 in and
out; gemlite's default dispatch for fp16 (its autotune runs on the first call of each shape).
Not a test.

    python -m bench.gemlite_peer [--ms 1,16,64] [--weights qkv,o,gate_up,down,lm_head] [--json out.json]

(gemlite travels to the GPU machine as a wheel: GPU_NOTES.md, "gemlite".)
"""

from __future__ import annotations

import argparse
import json

import torch

from bench.kernel_bench import copy_bandwidth, rand_q4, timed
from kernels import q4_layout, triton_linear

DEV = "cuda"
# out x in: the attention's qkv and o, one expert's gate_up and down, the lm_head
SHAPES = {"qkv": (5120, 2048), "o": (2048, 4096), "gate_up": (1536, 2048), "down": (2048, 768),
          "lm_head": (151936, 2048)}
COLD_BYTES = 256 << 20


def _gemlite(lin):
    """gemlite's A16W4 layer of lin's weights (fp16 scales and zeros)."""
    from gemlite.helper import A16W4_HQQ_INT

    n, k = lin.out_features, lin.in_features
    packed = lin.qs.view(n, k // 32, 16)
    wq = torch.cat([packed & 0x0F, packed >> 4], dim=-1).reshape(n, k)  # GGUF order per block
    scale = lin.scale.half()
    zero = (-lin.minv / lin.scale).half()
    return A16W4_HQQ_INT(device=DEV, dtype=torch.float16).from_weights(wq, scale, zero)


def _nbytes(layer) -> int:
    return sum(t.numel() * t.element_size() for t in
               (getattr(layer, a, None) for a in ("W_q", "scales", "zeros")) if torch.is_tensor(t))


def _err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref).abs().max() / ref.abs().max())


def compare(copy_gbs: float, ms_list, weights) -> list[dict]:
    g = torch.Generator(DEV).manual_seed(0)
    rows = []
    print(f"{'weight':<8} {'m':>3} {'who':<8} {'ms':>9} {'GB/s':>6} {'%copy':>6} {'rel err':>9} "
          f"{'determ':>6} {'b-inv':>6}  gemlite/ours", flush=True)
    for name in weights:
        n, k = SHAPES[name]
        base = rand_q4(n, k, g)
        ours = q4_layout.repack(base)
        copies = max(1, COLD_BYTES // (ours.qs.nbytes + ours.sm.nbytes))
        try:
            peers = [_gemlite(base)] + [_gemlite(base) for _ in range(copies - 1)]
        except Exception as e:  # noqa: BLE001 - reported and the run goes on
            print(f"{name}: gemlite failed to pack: {type(e).__name__}: {str(e)[:300]}", flush=True)
            peers = []
        mine = [ours] + [q4_layout.repack(base) for _ in range(copies - 1)]
        w64 = base.dequantize().double()
        x_all = torch.randn(max(ms_list), k, generator=g, device=DEV)
        for m in ms_list:
            x = x_all[:m].contiguous()
            x16 = x.half()
            out = torch.empty(m, n, device=DEV)
            turn = iter(range(1 << 30))
            ms_ours = timed(lambda: triton_linear.linear(mine[next(turn) % copies], x, out), "ours")
            y = triton_linear.linear(ours, x, torch.empty(m, n, device=DEV))
            y2 = triton_linear.linear(ours, x, torch.empty(m, n, device=DEV))
            y1 = triton_linear.linear(ours, x[:1].contiguous(), torch.empty(1, n, device=DEV))
            found = [("ours", ms_ours, ours.qs.nbytes + ours.sm.nbytes, _err(y, x.double() @ w64.T),
                      torch.equal(y, y2), torch.equal(y[:1], y1))]
            if peers:
                turn2 = iter(range(1 << 30))
                ms_gl = timed(lambda: peers[next(turn2) % copies](x16), "gemlite")
                try:
                    z, z2 = peers[0](x16), peers[0](x16)
                    z1 = peers[0](x16[:1].contiguous())
                    found.append(("gemlite", ms_gl, _nbytes(peers[0]),
                                  _err(z, x16.double() @ w64.T), torch.equal(z, z2),
                                  torch.equal(z[:1], z1)))
                except Exception as e:  # noqa: BLE001
                    print(f"{name} m={m}: gemlite failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
            for who, ms, nbytes, err, det, inv in found:
                gbs = nbytes / ms / 1e6
                ratio = found[-1][1] / ms_ours if who == "gemlite" else float("nan")
                print(f"{name:<8} {m:>3} {who:<8} {ms:>9.4f} {gbs:>6.0f} {100 * gbs / copy_gbs:>5.1f}% "
                      f"{err:>9.2e} {'yes' if det else 'NO':>6} {'yes' if inv else 'NO':>6}"
                      f"  {'' if ratio != ratio else f'{ratio:.2f}'}", flush=True)
                rows.append(dict(weight=name, shape=[n, k], m=m, who=who, ms=ms, gbs=gbs,
                                 pct_copy=100 * gbs / copy_gbs, rel_err=err, deterministic=det,
                                 batch_invariant=inv))
        peers, mine = [], []  # (freed before the next weight's copies)
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ms", default="1,16,64", help="rows of x")
    ap.add_argument("--weights", default="qkv,o,gate_up,down", help=f"of {','.join(SHAPES)}")
    ap.add_argument("--json")
    a = ap.parse_args()
    copy_gbs = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy {copy_gbs:.0f} GB/s", flush=True)
    rows = compare(copy_gbs, [int(m) for m in a.ms.split(",")], a.weights.split(","))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), copy_gbs=copy_gbs, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
