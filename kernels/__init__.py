"""S2-Attention kernels: the pattern and the one public op."""

from .interface import s2_attention
from .pattern import S2Pattern

__all__ = ["S2Pattern", "s2_attention"]
