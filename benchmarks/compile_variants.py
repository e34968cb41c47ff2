"""The kernel variants benchmarks/compile_check.py compiles for sm_90: signatures, constexprs, launch shapes.

Each :class:`Variant` names one Triton kernel specialisation: the argument
types (``signature``: "*bf16", "i32", ...), the constexpr values, the
arguments promised to be multiples of 16 (``div16``, what the launchers'
alignment lets Triton assume) and warps / stages. The lists follow the
launchers in spec_rl.kernels: the default configs at the shapes the package
meets, plus every sweep config with ``sweep=True``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import kernel_sweeps  # benchmarks/ is on sys.path when a script here runs
import torch


class Variant(NamedTuple):
    name: str
    kernel: Any  # a triton.JITFunction
    signature: dict
    constexprs: dict
    div16: list
    num_warps: int
    num_stages: int


def _pointers(signature: dict, *more: str) -> list[str]:
    """Every pointer argument (the launchers pass 16-byte aligned tensors) plus ``more``."""
    return [k for k, v in signature.items() if v.startswith("*")] + list(more)


def from_logits_variants(sweep: bool) -> list[Variant]:
    from spec_rl.kernels import configs
    from spec_rl.kernels.from_logits import verify_from_logits_kernel

    cfgs = (
        kernel_sweeps.LOGITS_SWEEP
        if sweep
        else [configs.LogitsConfig(4096, 8), configs.LogitsConfig(2048, 8), configs.LogitsConfig(1024, 4, block_r=4)]
    )
    out = []
    for dtype in ("bf16", "fp32"):
        sig = {
            "logits_ptr": f"*{dtype}",
            "ids_ptr": "*i64",
            "part_m_ptr": "*fp32",
            "part_s_ptr": "*fp32",
            "tgt_ptr": "*fp32",
            "row_sample_ptr": "*i32",
            "params_ptr": "*i32",
            "n_rows": "i32",
            "V": "i32",
            "T": "i32",
            "stride_b": "i32",
            "stride_t": "i32",
        }
        div = _pointers(sig, "V", "T", "stride_b", "stride_t")
        for cfg in cfgs:
            for packed in (True, False):
                const = dict(PACKED=packed, BLOCK_R=cfg.block_r, BLOCK_V=cfg.block_v)
                name = (
                    f"from_logits {dtype} packed={packed} BLOCK_R={cfg.block_r} BLOCK_V={cfg.block_v} w{cfg.num_warps}"
                )
                out.append(Variant(name, verify_from_logits_kernel, sig, const, div, cfg.num_warps, 1))
    return out


def lm_head_variants(sweep: bool) -> list[Variant]:
    from spec_rl.kernels import configs
    from spec_rl.kernels.lm_head import lm_head_partial_kernel

    bf16_cfgs = kernel_sweeps.LM_HEAD_SWEEP if sweep else kernel_sweeps.LM_HEAD_SWEEP[:1]
    todo = [("bf16", cfg, False, False, True) for cfg in bf16_cfgs]
    # fp16 + bias + ragged d; fp32 (IEEE dot) with the default fp32 config.
    todo.append(("fp16", kernel_sweeps.LM_HEAD_SWEEP[0], True, False, False))
    todo.append(("fp32", configs.LMHeadConfig(64, 64, 32, 4, 3), True, True, False))
    out = []
    for dtype, cfg, has_bias, dot_fp32, even_k in todo:
        sig = {
            "h_ptr": f"*{dtype}",
            "w_ptr": f"*{dtype}",
            "bias_ptr": "*fp32",
            "ids_ptr": "*i64",
            "row_off_ptr": "*i64",
            "part_m_ptr": "*fp32",
            "part_s_ptr": "*fp32",
            "tgt_ptr": "*fp32",
            "N": "i32",
            "V": "i32",
            "D": "i32",
            "stride_h": "i32",
            "stride_w": "i32",
            "n_vtiles": "i32",
            "tiles_per_split": "i32",
            "num_splits": "i32",
            "params_ptr": "*i32",
        }
        for row_map in (False, True):
            const = dict(
                HAS_BIAS=has_bias,
                HAS_ROW_MAP=row_map,
                ROW_ALIGN=8,
                EVEN_K=even_k,
                DOT_FP32=dot_fp32,
                BLOCK_M=cfg.block_m,
                BLOCK_N=cfg.block_n,
                BLOCK_K=cfg.block_k,
                FLATTEN=cfg.flatten,
            )
            name = (
                f"lm_head_partial {dtype} bias={has_bias} even_k={even_k} row_map={row_map} "
                f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages} "
                f"splits~{cfg.target_splits}" + (" flatten" if cfg.flatten else "")
            )
            div = _pointers(sig, "V", "D", "stride_h", "stride_w")
            out.append(Variant(name, lm_head_partial_kernel, sig, const, div, cfg.num_warps, cfg.num_stages))
    return out


def epilogue_variants() -> list[Variant]:
    from spec_rl.kernels.epilogue import EPILOGUE_BLOCK, epilogue_kernel

    sig = {
        **dict.fromkeys(("part_m_ptr", "part_s_ptr", "tgt_ptr", "old_ptr", "lp_out_ptr"), "*fp32"),
        "acc_out_ptr": "*i8",
        **dict.fromkeys(("n_ptr", "flag_ptr", "row_sample_ptr", "row_token_ptr"), "*i32"),
        "uids_ptr": "*i64",
        "params_ptr": "*i32",
        "N": "i32",
        "num_splits": "i32",
    }
    const = {"BLOCK": EPILOGUE_BLOCK, "USE_LIBDEVICE": True}
    return [
        Variant(f"epilogue mode={mode}", epilogue_kernel, sig, {"MODE": mode, **const}, _pointers(sig, "N"), 4, 1)
        for mode in (0, 1, 2, 3)
    ]


_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def _paged_signature(dt: str) -> dict:
    ints = (
        "stride_qb",
        "stride_qh",
        "stride_ob",
        "stride_oh",
        "stride_blk",
        "stride_kv",
        "stride_tok",
        "stride_head",
        "stride_btb",
        "tokens_per_split",
        "num_splits",
    )
    return {
        "q_ptr": f"*{dt}",
        "kv_ptr": f"*{dt}",
        "bt_ptr": "*i32",
        "seq_lens_ptr": "*i32",
        "out_ptr": f"*{dt}",
        "part_acc_ptr": "*fp32",
        "part_ml_ptr": "*fp32",
        "qk_scale": "fp32",
        **{k: "i32" for k in ints},
    }


def paged_attention_variants(sweep: bool) -> list[Variant]:
    """Paged decode attention at the engine's shapes, split and not, and the merge kernel.

    Defaults (``default_paged_attention_config``) for Qwen3 (G=2, D=128), Llama-3-8B (G=4,
    D=128), G=8, D=64 and D=256, fp16, the fp32 broadcast path and the tiny
    test models' D=8; ``sweep`` adds every ``SWEEP`` config at the Qwen3 shape.
    """
    from spec_rl.kernels import configs as C
    from spec_rl.kernels import paged_attention as PA

    shapes = [(2, 128, torch.bfloat16), (4, 128, torch.bfloat16), (8, 128, torch.bfloat16), (2, 64, torch.bfloat16)]
    shapes += [(2, 256, torch.bfloat16), (2, 128, torch.float16), (2, 128, torch.float32), (2, 8, torch.float32)]
    todo = [
        (g, d, dt, C.default_paged_attention_config(g, d, dt), split) for g, d, dt in shapes for split in (False, True)
    ]
    if sweep:
        todo += [(2, 128, torch.bfloat16, c, False) for c in kernel_sweeps.PAGED_ATTENTION_SWEEP]
    out = []
    for g, d, dt, cfg, split in todo:
        d_pad = C.next_pow2(max(d, 8))
        use_dot = cfg.use_dot and d_pad >= 16
        const = dict(
            G=g,
            G_PAD=max(16, C.next_pow2(g)) if use_dot else C.next_pow2(g),
            D=d,
            D_PAD=d_pad,
            BLOCK_SIZE=16,
            BLOCK_N=cfg.block_n,
            USE_DOT=use_dot,
            DOT_F32=dt == torch.float32,
            SPLIT=split,
        )
        sig = _paged_signature(_DTYPE_NAMES[dt])
        div = _pointers(sig, "stride_qb", "stride_qh", "stride_ob", "stride_oh", "stride_blk", "stride_kv")
        div += ["stride_tok", "stride_head"] if d % 16 == 0 else []
        name = (
            f"paged_decode {_DTYPE_NAMES[dt]} G={g} D={d} split={split} BLOCK_N={cfg.block_n} "
            f"{'dot' if use_dot else 'bcast'} w{cfg.num_warps} s{cfg.num_stages}"
        )
        out.append(Variant(name, PA.paged_decode_kernel, sig, const, div, cfg.num_warps, cfg.num_stages))
    msig = {
        "part_acc_ptr": "*fp32",
        "part_ml_ptr": "*fp32",
        "out_ptr": "*bf16",
        "stride_ob": "i32",
        "stride_oh": "i32",
        "num_splits": "i32",
    }
    mdiv = ["part_acc_ptr", "part_ml_ptr", "out_ptr", "stride_ob", "stride_oh"]
    out.append(
        Variant(
            "paged_decode_merge bf16 D=128", PA.paged_decode_merge_kernel, msig, {"D": 128, "D_PAD": 128}, mdiv, 2, 1
        )
    )
    return out


def all_variants(sweep: bool) -> list[Variant]:
    """Every variant, in the order compile_check.py reports them."""
    return from_logits_variants(sweep) + lm_head_variants(sweep) + epilogue_variants() + paged_attention_variants(sweep)


def default_variants() -> list[Variant]:
    """Only the configs the package picks on an H100/H200 at the Qwen3 shapes (bf16, V = 151936, G = 2, D = 128).

    From-logits: ``default_logits_config``, packed and padded; fused LM head: the sm_90 default of
    ``default_lm_head_config`` (``LM_HEAD_SWEEP[0]``) with and without a row map; the epilogue in every
    rule mode; paged decode: ``default_paged_attention_config``, split and not, and its merge. 11 variants
    (the GPU check's compile stage).
    """
    from spec_rl.kernels import configs

    lg = configs.default_logits_config(151936, torch.bfloat16, interpret=False)
    lm = kernel_sweeps.LM_HEAD_SWEEP[0]
    pa = configs.default_paged_attention_config(2, 128, torch.bfloat16)

    def keep(v: Variant) -> bool:
        c, first = v.constexprs, next(iter(v.signature.values()))
        kind = v.name.split()[0]
        if kind == "from_logits":
            return first == "*bf16" and (c["BLOCK_V"], c["BLOCK_R"], v.num_warps) == (
                lg.block_v,
                lg.block_r,
                lg.num_warps,
            )
        if kind == "lm_head_partial":
            return first == "*bf16" and (c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"]) == (
                lm.block_m,
                lm.block_n,
                lm.block_k,
            )
        if kind == "paged_decode":
            return first == "*bf16" and (c["G"], c["D"], c["BLOCK_N"]) == (2, 128, pa.block_n)
        return kind in ("epilogue", "paged_decode_merge")

    return [v for v in all_variants(False) if keep(v)]
