"""Records of the logging flags."""

from __future__ import annotations

from megatron.core.optimizer import OptimizerConfig as OPT
from megatron.training.flags import reasons
from megatron.training.flags.derive import as_int, none_if_empty, wandb_save_dir
from megatron.training.flags.record import IMPLEMENTED, Flag, ProjectFlag, no_op, same, to
from megatron.training.straggler import StragglerConfig as ST
from megatron.training.training_log import LoggingConfig as LOG

RECORDS = (
    Flag("log_interval", IMPLEMENTED, fills=(*same(LOG), to(ST, "report_interval"))),
    Flag("log_params_norm", IMPLEMENTED, fills=same(LOG)),
    Flag("log_throughput", IMPLEMENTED, fills=same(LOG)),
    Flag("log_progress", no_op(reasons.DIAGNOSTICS)),
    Flag("timing_log_level", IMPLEMENTED, type=int, fills=(to(LOG, "timing_log_level", as_int("timing_log_level")),)),
    Flag("timing_log_option", IMPLEMENTED, fills=same(LOG)),
    Flag("tensorboard_dir", IMPLEMENTED, fills=same(LOG)),
    Flag("tensorboard_log_interval", IMPLEMENTED, fills=same(LOG)),
    Flag("tensorboard_queue_size", IMPLEMENTED, fills=same(LOG)),
    Flag("log_timers_to_tensorboard", IMPLEMENTED, fills=same(LOG)),
    Flag("log_loss_scale_to_tensorboard", IMPLEMENTED, fills=same(LOG)),
    Flag("log_validation_ppl_to_tensorboard", IMPLEMENTED, fills=same(LOG)),
    Flag("log_memory_to_tensorboard", IMPLEMENTED, fills=same(LOG)),
    Flag("log_memory_interval", no_op(reasons.DIAGNOSTICS), type=int),
    Flag("log_device_memory_used", no_op(reasons.DIAGNOSTICS)),
    Flag("log_num_zeros_in_grad", IMPLEMENTED, fills=same(OPT, LOG)),
    Flag("log_max_attention_logit", no_op(reasons.DIAGNOSTICS)),
    Flag("barrier_with_L1_time", IMPLEMENTED, fills=same(LOG)),
    Flag("log_world_size_to_tensorboard", IMPLEMENTED, fills=same(LOG)),
    Flag("wandb_project", IMPLEMENTED, fills=(to(LOG, "wandb_project", none_if_empty("wandb_project")),)),
    Flag("wandb_exp_name", IMPLEMENTED, fills=same(LOG)),
    Flag("wandb_save_dir", IMPLEMENTED, fills=(to(LOG, "wandb_save_dir", wandb_save_dir),)),
    Flag("wandb_entity", IMPLEMENTED, fills=same(LOG)),
    Flag("logging_level", no_op(reasons.DIAGNOSTICS)),
    Flag("log_energy", no_op(reasons.DIAGNOSTICS)),
    # Megatron-LM's straggler flags (its straggler detector), absent from the flag table this project copies:
    # this project's records, with Megatron's names, defaults and meanings.
    Flag(
        "log_straggler",
        IMPLEMENTED,
        help="Every --log-interval iterations, name the ranks whose compute (forward-backward without the "
        "gradient sync) is slowest and fastest, with their slowdown against the median rank.",
        fills=same(ST),
        project=ProjectFlag(group="logging", option_strings=("--log-straggler",), default=False, action="storetrue"),
    ),
    Flag(
        "disable_straggler_on_startup",
        IMPLEMENTED,
        help="Start with the straggler report off (turned on through --straggler-ctrlr-port).",
        fills=same(ST),
        project=ProjectFlag(
            group="logging", option_strings=("--disable-straggler-on-startup",), default=False, action="storetrue"
        ),
    ),
    Flag(
        "straggler_ctrlr_port",
        IMPLEMENTED,
        help="Port of rank 0's HTTP endpoint that turns the straggler report on and off (0: any free port).",
        type=int,
        fills=same(ST),
        project=ProjectFlag(group="logging", option_strings=("--straggler-ctrlr-port",), default=65535, action="store"),
    ),
    Flag(
        "straggler_minmax_count",
        IMPLEMENTED,
        help="How many of the slowest and fastest ranks the straggler report names.",
        type=int,
        fills=same(ST),
        project=ProjectFlag(group="logging", option_strings=("--straggler-minmax-count",), default=1, action="store"),
    ),
)
