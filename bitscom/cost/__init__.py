"""bitscom.cost: an alpha-beta-gamma model of a data-parallel step, calibrated on the real
group and device. See docs/cost_model.md.

* :class:`Link`, :class:`Topology`: the network (latency, bandwidth; intra/inter node);
* :class:`Round`, :func:`rounds_of`, :func:`rounds_for`, :func:`sent_bytes`: the collectives one
  bucket costs with a compressor, in the bytes :class:`bitscom.comm.Comm` counts, learned by
  running its ``reduce`` on a :class:`LocalTransport`;
* :func:`round_seconds`: the time of one collective on a topology;
* :func:`probe_link`, :func:`fit_link`, :func:`calibrate_link`, :func:`time_codec`:
  calibration;
* :func:`predict_step`: a step with backward overlap;
* :class:`Auto`: ``compression="auto"``, the compressor the model predicts fastest per bucket
  (registered under that name here: it builds on the model, which builds on the compressors).

Example::

    from bitscom.cost import Link, Topology, rounds_for, round_seconds
    topo = Topology.flat(4, Link.from_gbit(1, latency_s=1e-4))
    sum(round_seconds(r, topo) for r in rounds_for("lowbit", 1 << 22, 4))
"""

from .auto import Auto, candidates_for
from .calibrate import calibrate_link, fit_link, parse_samples, probe_link, time_codec
from .formulas import round_seconds
from .fusion import CANDIDATE_MB, auto_fusion_threshold_mb, choose_fusion_threshold_mb
from .links import Link, Topology
from .local import LocalTransport, recorded_rounds
from .predict import Prediction, bucket_seconds, predict_step, ready_times
from .rounds import Round, layout_of, rounds_for, rounds_of, sent_bytes

__all__ = ["Auto", "candidates_for", "Link", "Topology", "Round", "rounds_for", "rounds_of", "sent_bytes", "round_seconds", "layout_of", "probe_link",
           "fit_link", "calibrate_link", "parse_samples", "time_codec", "predict_step", "Prediction",
           "ready_times", "bucket_seconds", "LocalTransport", "recorded_rounds",
           "choose_fusion_threshold_mb", "auto_fusion_threshold_mb", "CANDIDATE_MB"]
