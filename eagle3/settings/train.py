"""The ``train`` section (stage 04): EAGLE-3 training with training-time test (TTT)."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, StrictBool, StrictFloat, StrictInt, ValidationInfo, field_validator

from eagle3.settings.types import OnOff, Section


class TrainConfig(Section):
    """Stage 04: EAGLE-3 training with training-time test (TTT)."""

    ttt_length: StrictInt = Field(7, ge=1)
    step_weight: StrictFloat = Field(
        0.8, gt=0, description="loss weight of TTT step i is step_weight**i"
    )
    loss: Literal["soft_ce", "hard_ce", "tv", "lk_hybrid"] = Field(
        "soft_ce",
        description="per-token loss against the verifier (eagle3/losses/token.py token_loss): soft_ce = cross-entropy "
        "to its distribution over the draft vocab (EAGLE-3); hard_ce = cross-entropy to its argmax; tv = 1 - alpha, "
        "alpha = sum_v min(p_v, q_v) (acceptance probability); lk_hybrid = lam*KL + (1-lam)*(1-alpha), "
        "lam = exp(-lk_eta*alpha) per token (arXiv 2602.23881). Token means over the optimizer step as for soft_ce",
    )
    lk_eta: StrictFloat = Field(
        3.0,
        gt=0,
        description="eta of train.loss: lk_hybrid (3 = the LK paper's and speculators' default)",
    )
    lr: StrictFloat = Field(1e-4, gt=0)
    weight_decay: StrictFloat = Field(0.0, ge=0)
    warmup_ratio: StrictFloat = Field(0.02, ge=0, le=1)
    epochs: StrictFloat = Field(1.0, gt=0)
    max_steps: Optional[StrictInt] = Field(
        None,
        ge=1,
        description="cap on the optimizer steps of `epochs` (schedule horizon and end): a value above "
        "them changes nothing (a warning says so); raise `epochs` for a longer run",
    )
    batch_size: StrictInt = Field(
        1,
        ge=1,
        description="samples per process per micro-batch (ignored when batch_tokens is set)",
    )
    batch_tokens: Optional[StrictInt] = Field(
        None,
        ge=1,
        description="token-budget micro-batches instead of batch_size: samples of similar length "
        "(sorted within shuffled windows) up to this many padded tokens per process per micro-batch (eagle3/data/batching.py)",
    )
    num_workers: Optional[StrictInt] = Field(
        None,
        ge=0,
        description="data loader worker processes per rank; null = auto (GPU: up to 8 by CPU count, CPU: 0)",
    )
    grad_accum: StrictInt = Field(1, ge=1)
    grad_clip: StrictFloat = Field(0.5, gt=0)
    seed: StrictInt = 0
    log_every: StrictInt = Field(10, ge=1)
    eval_every: Optional[StrictInt] = Field(
        None,
        ge=1,
        description="validate every N optimizer steps (and at the end); default: at the end of each epoch "
        "(its last optimizer step, whatever the epoch's step count: with batch_tokens it varies from epoch to epoch)",
    )
    select_best: Literal["last", "sim_accept"] = Field(
        "last",
        description="which weights are exported: the last step's, or those of the validation with the highest "
        "simulated acceptance length tau_sim = 1 + sum_m prod_{j<=m} alpha_j (alpha_j = held-out top-1 of TTT position j; "
        "TorchSpec/SpecForge simulated_acc_len + 1; eagle3/train/sim_accept.py). The curve is reported either way",
    )
    select_chain: Optional[StrictInt] = Field(
        None,
        ge=1,
        description="chain length k of tau_sim for select_best; default benchmark.steps, capped at "
        "ttt_length (a warning says so). Set explicitly it must be <= ttt_length: tau_sim needs the acceptance of "
        "every chained position and training measures only the ttt_length TTT positions",
    )
    select_temperature: StrictFloat = Field(
        0.0,
        ge=0,
        description="the temperature the drafter will be served at, for tau_sim: 0 = alpha_j is the held-out top-1 "
        "agreement (greedy chains); > 0 = alpha_j is the held-out mean of sum_x min(p_T(x), q_T(x)), the acceptance "
        "probability of speculative rejection sampling at that temperature (05's benchmark.temperature; one more "
        "drafter unroll and full-vocab verifier head per validation batch)",
    )
    select_top_p: StrictFloat = Field(
        1.0,
        gt=0,
        le=1,
        description="nucleus filter of both distributions of select_temperature > 0 (05's benchmark.top_p)",
    )
    init_from: Optional[str] = Field(
        None,
        min_length=1,
        description="exported drafter folder (04's drafter-sglang / drafter-vllm, or a compatible EAGLE-3 export) "
        "whose weights start this run: a warm start with a fresh optimizer and schedule (SpecForge's / speculators' "
        "continue-from-a-drafter); its variant, shapes, verifier vocab and aux layers must be this run's. Under another "
        "vocab map (other data or data.draft_vocab_size) lm_head rows move by target token and tokens it never "
        "drafted keep their verifier init. A checkpoint of --resume overrides it",
    )
    ckpt_every: StrictInt = Field(500, ge=1)
    keep_checkpoints: StrictInt = Field(2, ge=1)
    bf16: OnOff = Field("auto", description="auto = bf16 autocast on GPU only")
    compile: StrictBool = Field(
        False,
        description="torch.compile the TTT objective (GPU: ~22% faster step after ~1 min compile)",
    )
    checkpoint_logits: OnOff = Field(
        "auto",
        description="recompute each TTT step's draft-vocab logits in backward; auto = off (the loss keeps only "
        "bf16 logits at loss positions; 'on' saves M x draft_V x 2 bytes per TTT step for ~12% more step time)",
    )
    hidden_states: Literal["offline", "online"] = Field(
        "offline",
        description="offline = 04 reads the verifier's hidden states from 02's shards; online = 02 writes "
        "token-only samples (input_ids + loss_mask, 16 bytes/token, format eagle3-tokens-v1) and 04 computes the states "
        "of each micro-batch itself with 02's capture code: extract.backend hf = the verifier in-process (verifier.dtype, "
        "frozen, one replica per rank), sglang = the capture server(s) of extract.sglang_url (DESIGN.md 'Online training')",
    )
    online_prefetch: StrictInt = Field(
        2,
        ge=1,
        description="online with extract.backend sglang: micro-batches captured ahead of training (a bounded "
        "queue: the capture of batch k+1 overlaps training on batch k; each waits in host memory)",
    )
    nproc_per_node: StrictInt = Field(
        1,
        ge=1,
        description="processes 04 is planned for (torchrun --nproc_per_node N; the global "
        "batch is batch_size x grad_accum x N): when the config sets it, 04 warns in one line if "
        "it runs in another number of processes (a plain `python 04_train.py` is one)",
    )
    output_dir: Optional[str] = Field(None, description="default {output_root}/train")

    @field_validator("select_chain")
    @classmethod
    def _chain_within_ttt(cls, v: Optional[int], info: ValidationInfo) -> Optional[int]:
        """An explicit ``select_chain`` longer than ``ttt_length`` cannot be simulated (no ``alpha_j`` past K)."""
        k = info.data.get("ttt_length")
        if v is not None and k is not None and v > k:
            raise ValueError(
                f"{v} is longer than train.ttt_length {k}: tau_sim({v}) needs the held-out acceptance of "
                f"{v} TTT positions and training measures {k}; set train.select_chain <= {k} or raise "
                f"train.ttt_length"
            )
        return v
