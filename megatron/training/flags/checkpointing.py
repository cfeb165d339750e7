"""Records of the checkpointing flags."""

from __future__ import annotations

from megatron.training.checkpoint_config import CheckpointConfig as CK
from megatron.training.checkpoint_formats.base import TORCH, TORCH_DIST
from megatron.training.flags import reasons
from megatron.training.flags.record import IMPLEMENTED, SPEED_BITWISE, Flag, ProjectFlag, no_op, not_yet, same

RECORDS = (
    Flag("save", IMPLEMENTED, help="Directory to save checkpoints to.", fills=same(CK)),
    Flag("save_interval", IMPLEMENTED, type=int, fills=same(CK)),
    Flag("save_wgrads_interval", not_yet(None), type=int),
    Flag("save_dgrads_interval", not_yet(None), type=int),
    Flag("save_retain_interval", not_yet(None), type=int),
    Flag("load", IMPLEMENTED, help="Directory to load checkpoints from.", fills=same(CK)),
    Flag("load_main_params_from_ckpt", not_yet(False)),
    Flag(
        "non_persistent_save_interval",
        IMPLEMENTED,
        type=int,
        help="Iterations between non-persistent checkpoints (besides the --save-interval ones); resume takes the "
        "newest complete checkpoint, persistent or not.",
        fills=same(CK),
    ),
    Flag(
        "non_persistent_ckpt_type",
        IMPLEMENTED,
        help="global: --ckpt-format files in --non-persistent-global-ckpt-dir, only the newest kept; local: each "
        "rank's own state in --non-persistent-local-ckpt-dir (in_memory is refused).",
        fills=same(CK),
    ),
    Flag("non_persistent_global_ckpt_dir", IMPLEMENTED, help="Default: <save>/non_persistent.", fills=same(CK)),
    Flag("non_persistent_local_ckpt_dir", IMPLEMENTED, fills=same(CK)),
    Flag(
        "non_persistent_local_ckpt_algo",
        IMPLEMENTED,
        help="fully_parallel and atomic both use the one local writer: each rank writes its own file, then its "
        "completion marker.",
        fills=same(CK),
    ),
    Flag("finetune", IMPLEMENTED, fills=same(CK)),
    Flag(
        "pretrained_checkpoint",
        IMPLEMENTED,
        help="While --load holds no checkpoint, load the weights from here as --finetune does; then resume --load.",
        fills=same(CK),
    ),
    Flag("ckpt_step", IMPLEMENTED, type=int, fills=same(CK)),
    Flag(
        "use_checkpoint_args",
        IMPLEMENTED,
        help="Take the model flags (architecture, tokenizer type, dropout) from the --load checkpoint.",
    ),
    Flag("use_mp_args_from_checkpoint_args", not_yet(False)),
    Flag("use_tokenizer_model_from_checkpoint_args", not_yet(True)),
    Flag("exit_on_missing_checkpoint", IMPLEMENTED, fills=same(CK)),
    Flag("ckpt_format", not_yet(TORCH, TORCH_DIST), fills=same(CK)),
    Flag("auto_detect_ckpt_format", no_op(reasons.CHECKPOINT_IO)),
    Flag("ckpt_convert_format", not_yet(None)),
    Flag("ckpt_convert_save", no_op(reasons.UNDER_REFUSED)),
    Flag("ckpt_convert_update_legacy_dist_opt_format", no_op(reasons.UNDER_REFUSED)),
    Flag("ckpt_fully_parallel_save", no_op(reasons.CHECKPOINT_IO)),
    Flag(
        "async_save",
        IMPLEMENTED,
        help="Save checkpoints in the background: a step waits only for a host snapshot of the tensors; "
        "the tracker names the checkpoint once every rank's files are written (torch_dist only).",
        fills=same(CK),
        speed_only=SPEED_BITWISE,
    ),
    Flag(
        "use_persistent_ckpt_worker",
        IMPLEMENTED,
        help="One background checkpoint writer (a thread) for the whole run instead of one per save.",
        fills=same(CK),
        speed_only=SPEED_BITWISE,
    ),
    Flag("ckpt_fully_parallel_load", no_op(reasons.CHECKPOINT_IO)),
    Flag("ckpt_assume_constant_structure", no_op(reasons.CHECKPOINT_IO)),
    Flag("strict_fsdp_dtensor_load", no_op(reasons.UNDER_REFUSED)),
    Flag(
        "dist_ckpt_strictness",
        IMPLEMENTED,
        help="Keys the model and a torch_dist checkpoint do not share: the default refuses both kinds "
        "(also checkpoint tensors the model does not use); see dist_checkpointing/validation.py.",
        fills=same(CK),
    ),
    Flag("dist_ckpt_save_pre_mcore_014", no_op(reasons.CHECKPOINT_IO)),
    Flag("dist_ckpt_optim_fully_reshardable", no_op(reasons.CHECKPOINT_IO)),
    Flag("distrib_optim_fully_reshardable_mem_efficient", no_op(reasons.CHECKPOINT_IO)),
    Flag("replication", not_yet(False)),
    Flag("replication_jump", no_op(reasons.UNDER_REFUSED), type=int),
    Flag("replication_factor", no_op(reasons.UNDER_REFUSED)),
    Flag("no_save_optim", IMPLEMENTED, fills=same(CK)),
    Flag("no_save_rng", IMPLEMENTED, fills=same(CK)),
    Flag("no_load_optim", IMPLEMENTED, fills=same(CK)),
    Flag("no_load_rng", IMPLEMENTED, fills=same(CK)),
    Flag("use_dist_ckpt_deprecated", IMPLEMENTED),
    Flag("dist_ckpt_format_deprecated", IMPLEMENTED, replaced_by="--ckpt-format"),
    Flag("ckpt_fully_parallel_save_deprecated", no_op(reasons.CHECKPOINT_IO)),
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
