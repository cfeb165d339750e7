"""Records of the checkpointing flags."""

from __future__ import annotations

from megatron.training.checkpoint_config import CheckpointConfig as CK
from megatron.training.flags.record import IMPLEMENTED, Flag, ProjectFlag, not_yet, same

RECORDS = (
    Flag("save", IMPLEMENTED, help="Directory to save checkpoints to.", fills=same(CK)),
    Flag("save_interval", IMPLEMENTED, type=int, fills=same(CK)),
    Flag("save_wgrads_interval", not_yet(None), type=int),
    Flag("save_dgrads_interval", not_yet(None), type=int),
    Flag("save_retain_interval", IMPLEMENTED, type=int),
    Flag("load", IMPLEMENTED, help="Directory to load checkpoints from.", fills=same(CK)),
    Flag("load_main_params_from_ckpt", IMPLEMENTED),
    Flag("non_persistent_save_interval", not_yet(None), type=int),
    Flag("non_persistent_ckpt_type", IMPLEMENTED),
    Flag("non_persistent_global_ckpt_dir", IMPLEMENTED),
    Flag("non_persistent_local_ckpt_dir", IMPLEMENTED),
    Flag("non_persistent_local_ckpt_algo", IMPLEMENTED),
    Flag("finetune", IMPLEMENTED, fills=same(CK)),
    Flag("pretrained_checkpoint", not_yet(None)),
    Flag("ckpt_step", IMPLEMENTED, type=int, fills=same(CK)),
    Flag(
        "use_checkpoint_args",
        IMPLEMENTED,
        help="Take the model flags (architecture, tokenizer type, dropout) from the --load checkpoint.",
    ),
    Flag("use_mp_args_from_checkpoint_args", not_yet(False)),
    Flag("use_tokenizer_model_from_checkpoint_args", IMPLEMENTED),
    Flag("exit_on_missing_checkpoint", IMPLEMENTED, fills=same(CK)),
    Flag("ckpt_format", not_yet("torch", "torch_dist"), fills=same(CK)),
    Flag("auto_detect_ckpt_format", IMPLEMENTED),
    Flag("ckpt_convert_format", not_yet(None)),
    Flag("ckpt_convert_save", IMPLEMENTED),
    Flag("ckpt_convert_update_legacy_dist_opt_format", IMPLEMENTED),
    Flag("ckpt_fully_parallel_save", IMPLEMENTED),
    Flag("async_save", IMPLEMENTED),
    Flag("use_persistent_ckpt_worker", IMPLEMENTED),
    Flag("ckpt_fully_parallel_load", IMPLEMENTED),
    Flag("ckpt_assume_constant_structure", IMPLEMENTED),
    Flag("strict_fsdp_dtensor_load", IMPLEMENTED),
    Flag(
        "dist_ckpt_strictness",
        IMPLEMENTED,
        help="Keys the model and a torch_dist checkpoint do not share: the default refuses both kinds "
        "(also checkpoint tensors the model does not use); see dist_checkpointing/validation.py.",
        fills=same(CK),
    ),
    Flag("dist_ckpt_save_pre_mcore_014", IMPLEMENTED),
    Flag("dist_ckpt_optim_fully_reshardable", IMPLEMENTED),
    Flag("distrib_optim_fully_reshardable_mem_efficient", IMPLEMENTED),
    Flag("replication", not_yet(False)),
    Flag("replication_jump", IMPLEMENTED, type=int),
    Flag("replication_factor", IMPLEMENTED),
    Flag("no_save_optim", IMPLEMENTED, fills=same(CK)),
    Flag("no_save_rng", IMPLEMENTED, fills=same(CK)),
    Flag("no_load_optim", IMPLEMENTED, fills=same(CK)),
    Flag("no_load_rng", IMPLEMENTED, fills=same(CK)),
    Flag("use_dist_ckpt_deprecated", IMPLEMENTED),
    Flag("dist_ckpt_format_deprecated", IMPLEMENTED),
    Flag("ckpt_fully_parallel_save_deprecated", IMPLEMENTED),
    # This project's own flag (not in Megatron-LM).
    Flag(
        "verify_checkpoint",
        IMPLEMENTED,
        help="Do not check checkpoint files against the SHA-256 sums in metadata.json on load.",
        fills=same(CK),
        project=ProjectFlag(
            group="checkpointing", option_strings=("--no-verify-checkpoint",), default=True, action="storefalse"
        ),
    ),
)
