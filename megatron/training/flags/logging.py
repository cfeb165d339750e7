"""Records of the logging flags."""

from __future__ import annotations

from megatron.core.optimizer import OptimizerConfig as OPT
from megatron.training.flags import reasons
from megatron.training.flags.derive import as_int, none_if_empty, wandb_save_dir
from megatron.training.flags.record import IMPLEMENTED, Flag, no_op, same, to
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
    Flag(
        "log_straggler",
        IMPLEMENTED,
        help="Every --log-interval iterations, name the ranks whose compute (forward-backward without the "
        "gradient sync) is slowest and fastest, with their slowdown against the median rank.",
        fills=same(ST),
    ),
    Flag("disable_straggler_on_startup", IMPLEMENTED, fills=same(ST)),
    Flag("straggler_ctrlr_port", IMPLEMENTED, type=int, fills=same(ST)),
    Flag("straggler_minmax_count", IMPLEMENTED, type=int, fills=same(ST)),
)
