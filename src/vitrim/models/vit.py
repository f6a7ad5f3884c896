"""The Vision Transformer: patches -> tokens (+[CLS], +position) -> pre-norm blocks -> norm -> pool -> head."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from vitrim.attention.rotary import rotary_table
from vitrim.models.attention_pool import AttentionPool
from vitrim.models.block import Block
from vitrim.models.config import ViTConfig
from vitrim.models.eva_names import load_eva_names, save_eva_names
from vitrim.models.layers import PatchEmbed
from vitrim.models.pos_embed import resample_pos_embed
from vitrim.reduce import TokenState
from vitrim.reduce.state import patch_positions
from vitrim.reduce.unmerge import tokens_on_grid


@dataclass
class ViTOutput:
    """Everything one forward pass can tell.

    logits: (B, num_classes). tokens: (B, N', D) final tokens after the last norm, prefix tokens first.
    kept_indices: one (B, k) long tensor per reduction that removed tokens, absolute patch positions (0 … P−1 of
    the input's grid); empty for dense models. keep_masks: one (B, P) tensor per training-time decision (1 = kept).
    attentions: one (B, H, N_b, N_b) tensor per block when asked (N_b = the tokens that block saw).
    token_sizes: (B, N') how many patches each final token stands for, when a reducer merged tokens.
    patch_to_token: one (B, P) long tensor per reduction: for each patch of the input's grid, the index of the
    patch token (0 … N'−prefix−1 after that reduction) that stands for it, −1 if dropped.
    block_positions: per block, (B, N_b − prefix) absolute patch positions of the tokens its attention saw, in
    their order; block_patch_to_token: per block, the ``patch_to_token`` map in force when its attention ran (None
    before any reduction). Recorded by the blocks as they run (see :mod:`vitrim.reduce.state`).
    """

    logits: Tensor
    tokens: Tensor
    kept_indices: list[Tensor] = field(default_factory=list)
    keep_masks: list[Tensor] = field(default_factory=list)
    attentions: list[Tensor] = field(default_factory=list)
    token_sizes: Tensor | None = None
    patch_to_token: list[Tensor] = field(default_factory=list)
    block_positions: list[Tensor] = field(default_factory=list)
    block_patch_to_token: list[Tensor | None] = field(default_factory=list)

    def tokens_on_grid(self) -> Tensor:
        """(B, P, D) the final patch tokens on the input's full grid (zeros for dropped patches); see
        :func:`vitrim.reduce.unmerge.tokens_on_grid`. The prefix count is read off the provenance."""
        if self.patch_to_token:
            n = int(self.patch_to_token[-1].max()) + 1  # every surviving patch token stands for at least one patch
        else:
            n = self.block_positions[-1].shape[1]  # nothing was reduced: the last block saw every patch token
        return tokens_on_grid(self.tokens, self.patch_to_token, self.tokens.shape[1] - n)


class VisionTransformer(nn.Module):
    """ViT / DeiT with timm's parameter names, so timm and DeiT state dicts load as they are.

    ``model(images)`` returns logits (B, num_classes) in training and evaluation alike; images (B, C, H, W) of any
    H, W divisible by the patch size (the position embedding is resampled as timm resamples it).
    """

    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        self.num_prefix = c.num_prefix
        self.patch_embed = PatchEmbed(c.img_size, c.patch_size, c.in_chans, c.embed_dim, bias=not c.pre_norm)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, c.embed_dim)) if c.class_token else None
        self.dist_token = nn.Parameter(torch.zeros(1, 1, c.embed_dim)) if c.distilled else None
        self.reg_token = nn.Parameter(torch.zeros(1, c.reg_tokens, c.embed_dim)) if c.reg_tokens else None
        self.pos_embed = nn.Parameter(torch.zeros(1, c.num_pos_prefix + self.patch_embed.num_patches, c.embed_dim))
        self.pos_drop = nn.Dropout(c.drop_rate)
        self.norm_pre: nn.Module = nn.LayerNorm(c.embed_dim, eps=c.norm_eps) if c.pre_norm else nn.Identity()
        rates = torch.linspace(0, c.drop_path_rate, c.depth, device="cpu").tolist()  # (CPU: also under meta)
        mlp = ("swiglu" if c.scale_mlp else "glu") if c.swiglu_mlp else "mlp"
        self.blocks = nn.ModuleList(
            Block(
                c.embed_dim,
                c.num_heads,
                mlp_ratio=c.mlp_ratio,
                qkv_bias=c.qkv_bias,
                qk_norm=c.qk_norm,
                proj_drop=c.drop_rate,
                attn_drop=c.attn_drop_rate,
                drop_path=rate,
                init_values=c.init_values,
                norm_eps=c.norm_eps,
                act=c.act_layer,
                mlp=mlp,
            )
            for rate in rates
        )
        self.norm: nn.Module = nn.Identity() if c.use_fc_norm else nn.LayerNorm(c.embed_dim, eps=c.norm_eps)
        self.attn_pool: AttentionPool | None = None
        if c.global_pool == "map":
            self.attn_pool = AttentionPool(
                c.embed_dim, c.num_heads, mlp_ratio=c.mlp_ratio, norm_eps=c.norm_eps, act=c.act_layer
            )
        self.fc_norm: nn.Module = nn.LayerNorm(c.embed_dim, eps=c.norm_eps) if c.use_fc_norm else nn.Identity()
        self.head_drop = nn.Dropout(c.drop_rate)
        self.head: nn.Module = nn.Linear(c.embed_dim, c.num_classes) if c.num_classes > 0 else nn.Identity()
        self.head_dist: nn.Module | None = None
        if c.distilled:
            self.head_dist = nn.Linear(c.embed_dim, c.num_classes) if c.num_classes > 0 else nn.Identity()
        self.reset_parameters()
        if c.use_rot_pos_emb:  # timm builds RoPE ViTs with its Eva class: save and load under Eva's names
            self.register_state_dict_post_hook(save_eva_names)
            self.register_load_state_dict_pre_hook(load_eva_names)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """timm's init: truncated normal (std 0.02) for linear weights and position embedding, zero biases."""
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        for token in (self.cls_token, self.dist_token, self.reg_token):
            if token is not None:
                nn.init.normal_(token, std=1e-6)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.trunc_normal_(module.weight, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

    # -- the forward pass, in the pieces timm names -------------------------------------------------------------

    def embed(self, images: Tensor, *, record: bool = True) -> TokenState:
        """Images (B, C, H, W) -> token state with (B, prefix + h·w, D) tokens (prefix: [CLS], dist, registers).

        ``record``: whether the blocks and reducers record provenance (``TokenState.record``): pictures and rollout
        need it; ``forward`` turns it off, so that plain inference makes no bookkeeping calls.
        """
        c = self.config
        grid = self.patch_embed.check_input(images)
        x = self.patch_embed(images)  # (B, h·w, D)
        B = x.shape[0]
        prefix = [t.expand(B, -1, -1) for t in (self.cls_token, self.dist_token, self.reg_token) if t is not None]
        pos = resample_pos_embed(
            self.pos_embed, grid, self.patch_embed.grid_size, c.num_pos_prefix, antialias=c.pos_embed_antialias
        )
        if c.no_embed_class:  # the position embedding covers the patches only: add, then put the prefix in front
            x = torch.cat([*prefix, x + pos], dim=1)
        else:
            x = torch.cat([*prefix, x], dim=1) + pos  # (B, prefix + h·w, D)
        x = self.norm_pre(self.pos_drop(x))
        num_patches = grid[0] * grid[1]
        rope = None
        if c.use_rot_pos_emb:
            head_dim = c.embed_dim // c.num_heads
            rope = rotary_table(
                grid, head_dim, ref_grid=c.ref_feat_shape, temperature=c.rope_temperature, device=x.device
            )
        positions = patch_positions(B, num_patches, x.device) if record or rope is not None else None
        return TokenState(
            x, self.num_prefix, positions, grid_patches=num_patches, rope=rope, training=self.training, record=record
        )

    def forward_blocks(self, state: TokenState, need_weights: bool = False) -> tuple[TokenState, list[Tensor]]:
        """Run every block; return the final state (before the last norm) and the attention maps if asked."""
        attentions: list[Tensor] = []
        for block in self.blocks:
            state, weights = block(state, need_weights=need_weights)
            if weights is not None:
                attentions.append(weights)
        return state, attentions

    def forward_features(self, images: Tensor) -> Tensor:
        """Images -> final tokens (B, N', D) after the last norm."""
        state, _ = self.forward_blocks(self.embed(images, record=False))
        return self.norm(state.tokens)

    def pool(self, tokens: Tensor, patch_weights: Tensor | None = None) -> Tensor:
        """(B, N', D) -> (B, D): the [CLS] token, the (weighted) mean of the patch tokens, or the attention pool.

        ``patch_weights`` (B, N' − prefix): how much each patch token counts (ToMe's sizes × DynamicViT's policy);
        registers and other prefix tokens are never pooled into the mean or the attention pool.
        """
        patches = tokens[:, self.num_prefix :]  # (B, n, D)
        if self.attn_pool is not None:
            return self.attn_pool(patches, patch_weights)
        if self.config.global_pool == "avg":
            if patch_weights is None:
                return patches.mean(dim=1)
            w = patch_weights.to(patches.dtype).unsqueeze(-1)  # (B, n, 1)
            return (patches * w).sum(dim=1) / w.sum(dim=1).clamp_min(1e-12)
        return tokens[:, 0]

    def forward_head(self, tokens: Tensor, pre_logits: bool = False, patch_weights: Tensor | None = None) -> Tensor:
        """Final tokens (B, N', D) -> logits (B, num_classes), or the pooled features (B, D) if ``pre_logits``."""
        if self.config.distilled and self.config.global_pool == "token":
            x_cls, x_dist = self.head_drop(tokens[:, 0]), self.head_drop(tokens[:, 1])
            if pre_logits:
                return (x_cls + x_dist) / 2
            assert self.head_dist is not None
            return (self.head(x_cls) + self.head_dist(x_dist)) / 2
        x = self.head_drop(self.fc_norm(self.pool(tokens, patch_weights)))
        return x if pre_logits else self.head(x)

    def forward_head_with_weights(
        self, tokens: Tensor, patch_weights: Tensor | None = None
    ) -> tuple[Tensor, Tensor | None]:
        """:meth:`forward_head`'s logits (B, num_classes), and the attention pool's query attention (B, H, 1, n) over
        the patch tokens (None for a [CLS] or mean pool, which attend to nothing): what relevance methods weigh by
        its gradient, as any other attention map, without knowing how the head is built."""
        if self.attn_pool is None:
            return self.forward_head(tokens, patch_weights=patch_weights), None
        pooled, weights = self.attn_pool.pool_with_weights(tokens[:, self.num_prefix :], patch_weights)  # (B, D)
        return self.head(self.head_drop(self.fc_norm(pooled))), weights

    def forward(self, images: Tensor) -> Tensor:
        """Images (B, C, H, W) -> logits (B, num_classes)."""
        state, _ = self.forward_blocks(self.embed(images, record=False))
        weights = state.patch_weights() if self.pools_patches else None
        return self.forward_head(self.norm(state.tokens), patch_weights=weights)

    @property
    def pools_patches(self) -> bool:
        """Whether the head reads the patch tokens (mean or attention pool), so that their weights matter."""
        return self.attn_pool is not None or self.config.global_pool == "avg"

    def forward_detailed(self, images: Tensor, need_weights: bool = False) -> ViTOutput:
        """One forward pass that reports everything (see :class:`ViTOutput`); the logits equal ``model(images)``."""
        state, attentions = self.forward_blocks(self.embed(images), need_weights=need_weights)
        tokens = self.norm(state.tokens)
        logits = self.forward_head(tokens, patch_weights=state.patch_weights())
        return ViTOutput(
            logits=logits,
            tokens=tokens,
            kept_indices=list(state.kept_indices),
            keep_masks=list(state.keep_masks),
            attentions=attentions,
            token_sizes=state.sizes,
            patch_to_token=list(state.patch_to_token),
            block_positions=list(state.block_positions),
            block_patch_to_token=list(state.block_patch_to_token),
        )

    def no_weight_decay(self) -> set[str]:
        """Parameters that AdamW should not decay (timm's convention)."""
        return {"pos_embed", "cls_token", "dist_token", "reg_token", "attn_pool.latent"}
