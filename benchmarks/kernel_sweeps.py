"""Kernel tile configs the GPU benchmarks time with ``--sweep`` (the package picks one per shape:
spec_rl.kernels.configs); the first of each list is the Hopper default."""

from spec_rl.kernels.configs import LMHeadConfig, LogitsConfig, PagedAttentionConfig

# benchmarks/gpu_suite.py --sweep
LOGITS_SWEEP = [
    LogitsConfig(2048, 8),
    LogitsConfig(1024, 4),
    LogitsConfig(2048, 4),
    LogitsConfig(4096, 8),
    LogitsConfig(4096, 16),
    LogitsConfig(8192, 16),
]
LM_HEAD_SWEEP = [
    LMHeadConfig(128, 256, 64, 8, 3),
    LMHeadConfig(128, 256, 64, 8, 4),
    LMHeadConfig(128, 128, 64, 8, 3),
    LMHeadConfig(128, 128, 64, 8, 3, flatten=True),
    LMHeadConfig(128, 128, 64, 8, 4),
    LMHeadConfig(128, 128, 64, 4, 4),
    LMHeadConfig(256, 128, 64, 8, 3),
    LMHeadConfig(128, 256, 64, 8, 3, target_splits=8),
    LMHeadConfig(128, 256, 64, 8, 3, target_splits=32),
]
# benchmarks/bench_paged_attention.py --sweep
PAGED_ATTENTION_SWEEP = [
    PagedAttentionConfig(64, 8, True, 2),  # default at D=128, bf16
    PagedAttentionConfig(64, 8, True, 3),
    PagedAttentionConfig(64, 4, True, 3),
    PagedAttentionConfig(128, 8, True, 2),
    PagedAttentionConfig(32, 4, True, 3),
    PagedAttentionConfig(32, 4, False, 1),  # fp32-exact broadcast path
    PagedAttentionConfig(16, 4, False, 1),
]
