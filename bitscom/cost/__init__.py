"""bitscom.cost: an alpha-beta-gamma model of a data-parallel step, calibrated on the real
group and device (docs/cost_model.md): links and topologies, the rounds a compressor issues
(learned by running it on a :class:`LocalTransport`), their times, calibration, whole-step
prediction with backward overlap, and :class:`Auto` (``compression="auto"``, registered here).
"""

from .auto import Auto, candidates_for
from .calibrate import calibrate_link, fit_link, parse_samples, probe_link, time_codec
from .formulas import round_seconds
from .fusion import CANDIDATE_MB, auto_fusion_threshold_mb, choose_fusion_threshold_mb
from .links import Link, Topology
from .local import LocalTransport, recorded_rounds
from .predict import Prediction, bucket_seconds, predict_step, ready_times
from .rounds import Round, layout_of, rounds_for, rounds_of, sent_bytes

__all__ = ["Auto", "candidates_for", "Link", "Topology", "Round", "rounds_for", "rounds_of", "sent_bytes",
           "round_seconds", "layout_of", "probe_link", "fit_link", "calibrate_link", "parse_samples", "time_codec",
           "predict_step", "Prediction", "ready_times", "bucket_seconds", "LocalTransport", "recorded_rounds",
           "choose_fusion_threshold_mb", "auto_fusion_threshold_mb", "CANDIDATE_MB"]
