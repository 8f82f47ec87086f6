"""The controllers' configuration: the what-if controller's and the paper's threshold
rules' (docs/scheduling.md), one frozen dataclass whose fields are the
``[controller]`` keys. Validated on construction. Not owned here: the controllers
(``rules``, ``whatif``).
"""

from __future__ import annotations

from dataclasses import dataclass

from vertumnus.policy.geometry import LatticeError

CONTROLLER_MODES = ("whatif", "rules")


@dataclass(frozen=True)
class ControllerConfig:
    # "whatif": predict each candidate composition's TTFT and act on the gain
    # (policy/control/whatif.py, the default); "rules": the paper's threshold rules below.
    mode: str = "whatif"
    window_s: float = 30.0  # the rules' window (and the capacity kappa's)
    # -- the what-if controller -------------------------------------------------------
    decision_s: float = 10.0  # its decision period
    horizon_s: float = 30.0  # forecast: the arrivals of at least this long ...
    min_requests: int = 400  # ... or this many ...
    max_horizon_s: float = 90.0  # ... never older than this
    margin: float = 0.015  # least pessimistic gain to reshape (widened by the audit)
    op_cost: float = 0.005  # each operation of a candidate adds this to its score
    # A candidate is priced from the live state over the forecast replayed for
    # payback_s, extended while the backlog its transition built drains (to at
    # most max_payback_s).
    payback_s: float = 120.0
    max_payback_s: float = 300.0
    # ... and, once that backlog has drained, over the load's expected dwell (each
    # span past those replayed as the last one): (dwell_prior_s + the time served)
    # / (1 + the rate changes the forecast saw), at most dwell_max_s (a load seen
    # steady is expected to last; one that changed often, less). 0: no dwell.
    dwell_prior_s: float = 300.0
    dwell_max_s: float = 600.0
    # The gain's significance (a paired z over batches of the forecast): a move
    # wins two decisions in a row at z_confirm or more, or acts at once where the
    # load moved (overload, a rate change) at z_urgent; a weaker one must win
    # confirm_limit decisions in a row, their mean pessimistic gain over the margin.
    z_confirm: float = 2.0
    z_urgent: float = 3.0
    # ... and a pessimistic gain of at least urgent_gain at z_urgent acts at once at
    # any load, in the warm-up and while an audit watches too (0: never): there,
    # waiting for a second decision costs more than the audited error can.
    urgent_gain: float = 0.2
    confirm_limit: int = 3
    significance_batches: int = 8
    # The audit of every move: a candidate's J is priced at J * (1 + pessimism),
    # the audited error of its kind of move and load band, with a prior per band
    # counted move_error_weight times. The priors are the mean absolute errors of
    # the move audits on the robustness suite's tune seeds (docs/scheduling.md).
    move_error_prior_light: float = 0.02
    move_error_prior_loaded: float = 0.07
    move_error_prior_saturated: float = 0.20
    move_error_weight: float = 2.0
    audit_weight: float = 0.25  # margins widen by this times the audit's error
    calibrate: bool = True  # scale predictions by measured over predicted service
    replay_requests: int = 1500  # replays thin a larger forecast (time dilation)
    overload_utilisation: float = 0.9  # predicted busy fraction that is overload
    # Scale-in keeps headroom: with the forecast's arrivals this many times as fast, a
    # merge must not be overloaded (busy overload_utilisation or more) and slower than
    # holding there (the next burst must fit). ``headroom_overload = false``: any
    # slowdown there refuses it, however much headroom it keeps.
    headroom_rate: float = 2.0
    headroom_overload: bool = True
    # ... and a rise must not cost it more than it gains: with the arrivals as fast
    # as holding would be way_back_utilisation busy (at most way_back_rate_max
    # times the forecast's), a merge split back way_back_react_s into the rise
    # (after its drain and the switch) may lose no more than its gain (0: no check).
    # Near saturation a lost second of capacity is a backlog that outlives the
    # rise, so the rise priced goes that far (the tune seeds: 0.85 let three merges
    # through that steps of 2.2-3x then cost 5-13 %).
    way_back_utilisation: float = 0.95
    way_back_rate_max: float = 4.0
    way_back_react_s: float = 20.0
    saturated_moves: int = 2  # operations priced (and taken) at once near saturation
    # A move back towards the composition the pool started in is judged against
    # holding that start (whose exposure to a rise is the baseline): a merge's
    # way back does not refuse it (the headroom check still does), nor does the
    # steady check refuse a split back.
    start_is_home: bool = True
    # A move must also beat holding in the steady state on every arrival since the
    # last rate change (at most steady_horizon_s), replayed at the forecast's rate:
    # a gain that the last horizon_s alone shows is noise in the mix (a few long
    # prompts), not a change of load.
    steady_check: bool = True
    steady_horizon_s: float = 300.0
    max_moves_fraction: float = 0.5  # of the workers, reshaping at once (at least 1)
    # -- the rules -----------------------------------------------------------------
    upper_fraction: float = 0.85
    lower_fraction: float = 0.45
    split_after_windows: int = 1
    merge_after_windows: int = 3
    long_tokens: int = 32_768
    long_shift: float = 0.10
    stable_demand: float = 0.15
    long_after_windows: int = 3
    max_splits_per_window: int = 4
    max_concurrent_reshapes: int = 2

    def __post_init__(self) -> None:
        if self.mode not in CONTROLLER_MODES:
            raise LatticeError(
                f"mode must be one of {', '.join(CONTROLLER_MODES)}, got {self.mode!r}"
            )
        if not self.window_s > 0 or not self.decision_s > 0:
            raise LatticeError("window_s and decision_s must be > 0")
        if not 0 < self.horizon_s <= self.max_horizon_s or self.min_requests < 1:
            raise LatticeError("need 0 < horizon_s <= max_horizon_s and min_requests >= 1")
        if not 0 <= self.margin < 1 or self.replay_requests < 50:
            raise LatticeError("need 0 <= margin < 1 and replay_requests >= 50")
        if not self.steady_horizon_s > 0:
            raise LatticeError("steady_horizon_s must be > 0")
        if not 0 < self.payback_s <= self.max_payback_s:
            raise LatticeError("need 0 < payback_s <= max_payback_s")
        if not (self.dwell_prior_s >= 0 and self.dwell_max_s >= 0):
            raise LatticeError("need dwell_prior_s >= 0 and dwell_max_s >= 0")
        if not 0 <= self.urgent_gain < 1:
            raise LatticeError("need 0 <= urgent_gain < 1 (0: off)")
        if not (0 < self.z_confirm <= self.z_urgent and self.confirm_limit >= 2):
            raise LatticeError("need 0 < z_confirm <= z_urgent and confirm_limit >= 2")
        if self.headroom_rate < 1:
            raise LatticeError("headroom_rate must be >= 1")
        if not (0 <= self.way_back_utilisation < 1 and self.way_back_rate_max >= 1
                and self.way_back_react_s >= 0):  # fmt: skip
            raise LatticeError(
                "need 0 <= way_back_utilisation < 1, way_back_rate_max >= 1, way_back_react_s >= 0"
            )
        if self.significance_batches < 2 or self.saturated_moves < 1:
            raise LatticeError("need significance_batches >= 2 and saturated_moves >= 1")
        if not (self.op_cost >= 0 and self.audit_weight >= 0):
            raise LatticeError("need op_cost >= 0 and audit_weight >= 0")
        priors = (self.move_error_prior_light, self.move_error_prior_loaded,
                  self.move_error_prior_saturated)  # fmt: skip
        if not (min(priors) >= 0 and self.move_error_weight > 0):
            raise LatticeError("need move_error_prior_* >= 0 and move_error_weight > 0")
        if not (0 < self.max_moves_fraction <= 1 and self.overload_utilisation > 0):
            raise LatticeError("need 0 < max_moves_fraction <= 1, overload_utilisation > 0")
        if not 0 < self.lower_fraction < self.upper_fraction:
            raise LatticeError("need 0 < lower_fraction < upper_fraction")
        windows = (self.split_after_windows, self.merge_after_windows, self.long_after_windows)
        if min(windows) < 1:
            raise LatticeError("persistence must be at least one window")
        if self.max_splits_per_window < 1 or self.max_concurrent_reshapes < 1:
            raise LatticeError("max_splits_per_window and max_concurrent_reshapes must be >= 1")
        if not (self.long_shift > 0 and self.stable_demand >= 0 and self.long_tokens >= 1):
            raise LatticeError("long_shift must be > 0, stable_demand >= 0, long_tokens >= 1")

    @property
    def move_error_priors(self) -> dict[str, float]:
        """Per load band (``audit.band_of``)."""
        return {
            "light": self.move_error_prior_light,
            "loaded": self.move_error_prior_loaded,
            "saturated": self.move_error_prior_saturated,
        }

    @property
    def period_s(self) -> float:
        """How often the driver asks for a decision."""
        return self.decision_s if self.mode == "whatif" else self.window_s
