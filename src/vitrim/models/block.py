"""The pre-norm Transformer block: [reducer before], x + Attn(LN(x)), [reducer after], x + MLP(LN(x)).

A reducer that looks ahead (MCTF) reduces between the first two steps, by the attention of the tokens entering the
block, and the block then applies that attention, merged, instead of computing it again.
"""

from __future__ import annotations

from torch import Tensor, nn

from vitrim.attention import MultiHeadAttention
from vitrim.models.layers import DropPath, GluMlp, LayerScale, Mlp, SwiGLU
from vitrim.reduce import Reducer, TokenState


class Block(nn.Module):
    """One encoder block; parameter names are timm's (``norm1``, ``attn``, ``ls1``, ``norm2``, ``mlp``, ``ls2``).

    ``reducer`` (a :class:`~vitrim.reduce.Reducer`, or None) is called before attention and between attention and
    MLP (its two hooks). It is a plain attribute, not a submodule.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        *,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        qk_norm: bool = False,
        proj_drop: float = 0.0,
        attn_drop: float = 0.0,
        drop_path: float = 0.0,
        init_values: float | None = None,
        norm_eps: float = 1e-6,
        act: str = "gelu",
        mlp: str = "mlp",
    ) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=norm_eps)
        self.attn = MultiHeadAttention(
            dim, num_heads, qkv_bias=qkv_bias, qk_norm=qk_norm, attn_drop=attn_drop, proj_drop=proj_drop
        )
        self.ls1: nn.Module = LayerScale(dim, init_values) if init_values else nn.Identity()
        self.drop_path1: nn.Module = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = nn.LayerNorm(dim, eps=norm_eps)
        hidden = int(dim * mlp_ratio)
        self.mlp: nn.Module
        if mlp == "glu":  # SwiGLU, packed (EVA-02 S/Ti)
            self.mlp = GluMlp(dim, hidden, drop=proj_drop)
        elif mlp == "swiglu":  # SwiGLU with a norm (EVA-02 B/L)
            self.mlp = SwiGLU(dim, hidden, drop=proj_drop, norm_eps=norm_eps)
        else:
            self.mlp = Mlp(dim, hidden, drop=proj_drop, act=act)
        self.ls2: nn.Module = LayerScale(dim, init_values) if init_values else nn.Identity()
        self.drop_path2: nn.Module = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.reducer: Reducer | None = None

    def forward(self, state: TokenState, *, need_weights: bool = False) -> tuple[TokenState, Tensor | None]:
        """Run the block on a token state. Returns the new state and the attention weights (B, H, N, N) if asked."""
        reducer = self.reducer
        ahead = None
        if reducer is not None:
            state = reducer.before_attention(state)
            if reducer.looks_ahead:  # MCTF: reduce by this block's own attention, then reuse it, merged
                weights, q, k = self.attn.attention_weights(
                    self.norm1(state.tokens), mask=state.attention_bias(), rope=state.rotary()
                )
                state, merged = reducer.reduce_ahead(state, weights)
                ahead = None if merged is None else (merged, q, k)
        state = state.record_block()  # provenance (if recorded): the tokens this block's attention sees
        attention = self.attn.attend(
            self.norm1(state.tokens),  # (B, N, D)
            mask=state.attention_bias(),  # (B, 1, 1, N) log-sizes, or None
            keep_policy=state.keep_policy,
            need_weights=need_weights,
            rope=state.rotary(),  # (B, 1, n, 2·hd) by absolute position, or None
            ahead=ahead,  # (B, H, N, N) weights computed ahead and merged, or None
            no_empty_rows=True,  # log-sizes are finite and prefix tokens have size 1: no row is ever closed
        )
        x = state.tokens + _residual(self.drop_path1, self.ls1, attention.out)
        if reducer is not None:
            state = reducer.after_attention(state.replace(tokens=x), attention)
            x = state.tokens
        x = x + _residual(self.drop_path2, self.ls2, self.mlp(self.norm2(x)))
        return state.replace(tokens=x), attention.weights

    def extra_repr(self) -> str:
        return f"reducer={self.reducer!r}" if self.reducer is not None else ""


def _residual(drop_path: nn.Module, layer_scale: nn.Module, x: Tensor) -> Tensor:
    """drop_path(layer_scale(x)), without calling the modules that are identities (a call costs more than the check)."""
    if not isinstance(layer_scale, nn.Identity):
        x = layer_scale(x)
    return x if isinstance(drop_path, nn.Identity) else drop_path(x)
