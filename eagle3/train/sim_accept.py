"""Best checkpoint by simulated acceptance length (``train.select_best: sim_accept``).

Every validation of 04 (``train.eval_every`` optimizer steps, and at the end) gives the held-out top-1 agreement
``alpha_j`` of each TTT position ``j = 1..K`` (``acc_{j-1}`` of the validation row, token-weighted), an estimate of
P(draft j accepted | drafts 1..j-1 accepted) of greedy chain decoding; one verify step with a chain of ``k`` drafts
then emits on average

    tau_sim(k) = 1 + sum_{m=1..k} prod_{j=1..m} alpha_j

tokens (the 1 is the verifier's bonus token, as 05 counts tau: DESIGN.md "Acceptance counts emitted tokens only").
TorchSpec ``eagle3_trainer.py`` and SpecForge ``specforge/eval/evaluator.py`` (``simulated_acc_len``) report
``tau_sim(K) - 1``. ``k`` is ``train.select_chain`` (default ``benchmark.steps``) capped at ``train.ttt_length``
(:func:`effective_chain`). Positions whose verifier argmax is outside the draft vocab are not counted, so with a
small draft vocab ``alpha_j`` is slightly optimistic.

:class:`BestTracker` keeps the curve (``{train_dir}/sim_accept.json``: one row per validation) and the weights of the
best validation so far (``{train_dir}/best_drafter.pt``: the trainable tensors, written atomically); the run exports
those under ``select_best: sim_accept``. A resume drops the rows after its checkpoint's step but keeps a saved best
taken after it (marked ``before_resume: true``) until a validation of the resumed run beats it.

At ``train.select_temperature`` T > 0 ``alpha_j`` is the expected acceptance of speculative rejection sampling
(:mod:`eagle3.train.sampled_accept`); the curve records the temperature and a resume at another one is refused.
"""

from __future__ import annotations

import io
import logging
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from eagle3.errors import UserError
from eagle3.io import atomic_torch_save, atomic_write_bytes, atomic_write_json, read_json
from eagle3.io.read import safe_torch_load
from eagle3.train import checkpoint as ckpt
from eagle3.train.sampled_accept import SAMPLED_KEY, SampledAcceptance

log = logging.getLogger(__name__)

CURVE_FILE = "sim_accept.json"
BEST_FILE = "best_drafter.pt"
PLOT_FILE = "sim_accept.png"


def position_acceptance(val: dict, key: str = "acc") -> list[float]:
    """``[alpha_1, ..., alpha_K]``: the ``{key}_{j}`` entries of a validation row in order (``acc``: top-1,
    :meth:`eagle3.train.metrics.Accum.summarize`; :data:`SAMPLED_KEY`: :meth:`SampledAcceptance.summarize`)."""
    out, j = [], 0
    while f"{key}_{j}" in val:
        out.append(float(val[f"{key}_{j}"]))
        j += 1
    return out


def simulated_tau(alpha: list[float], chain: int) -> float:
    """``1 + sum_{m=1..k} prod_{j<=m} alpha_j`` with ``k = min(chain, len(alpha))`` (module docstring).

    Args:
        alpha: per-position acceptance ``alpha_1..alpha_K`` in ``[0, 1]``.
        chain: draft tokens per verify step (>= 1).

    Raises:
        ValueError: ``chain < 1`` or an ``alpha`` outside ``[0, 1]``.
    """
    if chain < 1:
        raise ValueError(f"chain must be >= 1, got {chain}")
    if any(not 0.0 <= a <= 1.0 for a in alpha):
        raise ValueError(f"per-position acceptance must lie in [0, 1], got {alpha}")
    tau, run = 1.0, 1.0
    for a in alpha[:chain]:
        run *= a
        tau += run
    return tau


def effective_chain(
    select_chain: Optional[int], bench_steps: int, ttt_length: int
) -> tuple[int, Optional[str]]:
    """The chain ``k`` that ``tau_sim(k)`` really scores, and a warning when it is shorter than the one asked for.

    ``k`` = ``train.select_chain``, else ``benchmark.steps``, capped at ``train.ttt_length``: validation measures
    ``alpha_1..alpha_K`` only, so a longer chain would be scored as ``tau_sim(K)`` under another name. An explicit
    ``select_chain`` above ``ttt_length`` is refused by the config; the default (``benchmark.steps``) is capped here.

    Returns:
        ``(k, warning)``; ``warning`` is None when nothing was capped.
    """
    want = int(select_chain or bench_steps)
    if want <= ttt_length:
        return want, None
    src = "train.select_chain" if select_chain else "train.select_chain defaults to benchmark.steps"
    return ttt_length, (
        f"simulated acceptance scored as tau_sim({ttt_length}), not tau_sim({want}): {src} = {want} "
        f"but training measures only train.ttt_length = {ttt_length} TTT positions (set "
        f"train.select_chain <= {ttt_length}, or raise train.ttt_length)"
    )


class BestTracker:
    """The simulated-acceptance curve of one run and the weights of its best validation (module docstring).

    Args:
        train_dir: the run's ``train.output_dir``.
        chain: chain length ``k`` of the selection score ``tau_sim(k)``.
        enabled: write files (rank 0 only; other ranks track nothing).
        start_step: the step training (re)starts from; rows after it are dropped.
        keep_best: save the best weights (``train.select_best: sim_accept``); else only the curve.
        end_step: the step this run ends at (``--stop-at``, ``--max-steps``); a best kept from before the resume that
            lies past it is dropped (the run's export never holds weights of a step after its end). None: no limit.
        temperature, top_p: ``train.select_temperature`` / ``train.select_top_p``; temperature 0 scores the top-1
            ``alpha`` (``acc_{j}``), > 0 the sampled acceptance (``sampled_acc_{j}``, :meth:`meter`); a row keeps the
            top-1 one as ``alpha_top1`` then.

    Raises:
        UserError: a resume whose curve was measured at another temperature / top-p.
    """

    def __init__(
        self,
        train_dir: Path,
        chain: int,
        enabled: bool,
        start_step: int = 0,
        keep_best: bool = False,
        end_step: Optional[int] = None,
        temperature: float = 0.0,
        top_p: float = 1.0,
    ):
        self.dir = Path(train_dir)
        self.end_step = end_step
        self.chain = int(chain)
        self.temperature, self.top_p = float(temperature), float(top_p)
        self.enabled = enabled
        self.keep_best = keep_best
        self.rows: list[dict] = []
        # the best row, when its weights are on disk (or not needed)
        self.best: Optional[dict] = None
        if enabled:
            self._load(start_step)

    def _curve_problem(self, old: Any, on_disk: bool) -> Optional[str]:
        """Why the curve read back (``old``; ``on_disk`` False: there is none, only a best file) cannot be continued,
        or None: it holds no ``rows`` list, or (``on_disk``) it was measured at other sampling settings."""
        if not isinstance(old, dict) or not isinstance(old.get("rows"), list):
            return "key 'rows' missing (delete the file to start the curve again)"
        was = (float(old.get("temperature", 0.0)), float(old.get("top_p", 1.0)))
        if not on_disk or was == self._sampling():
            return None
        return (
            f"curve measured at train.select_temperature {was[0]:g}, select_top_p {was[1]:g}, now "
            f"{self.temperature:g}, {self.top_p:g}; set them back, or delete {CURVE_FILE} and {BEST_FILE}"
        )

    def _load(self, start_step: int) -> None:
        path = self.dir / CURVE_FILE
        best_path = self.dir / BEST_FILE
        # a best file without a curve (sim_accept): a kill between the first validation's two writes, its row the best
        first = self.keep_best and best_path.is_file() and not path.is_file()
        if start_step == 0 or not (path.is_file() or first):
            for p in (path, best_path):
                p.unlink(missing_ok=True)
            return
        old = read_json(path) if path.is_file() else {"rows": []}
        problem = self._curve_problem(old, path.is_file())
        if problem:
            raise UserError(f"{path}: {problem}")
        if int(old.get("chain", self.chain)) != self.chain:
            log.warning(
                "%s: curve scored with chain %s, now %d; rescored",
                path,
                old.get("chain"),
                self.chain,
            )
        self.rows = [self._score(r) for r in old["rows"] if int(r["step"]) <= start_step]
        best = old.get("best")
        # the best file is written first: newer than the curve after a kill between the two
        if self.keep_best and best_path.is_file():
            best = _best_file_row(best_path, best)
        if self._keep(path, best, start_step):
            self.best = self._score(dict(best))
            if int(best["step"]) > start_step:
                self.best["before_resume"] = True
                log.info(
                    "%s: the best validation so far, step %d (tau_sim(%d) %.4f), came after the checkpoint "
                    "resumed from (step %d); its weights stay in %s until a validation of this run beats it",
                    path,
                    int(best["step"]),
                    self.chain,
                    self.best["tau_sim"],
                    start_step,
                    BEST_FILE,
                )
        else:
            best_path.unlink(missing_ok=True)
            rows = [] if self.keep_best else self.rows  # sim_accept: no weights, no best
            self.best = max(rows, key=lambda r: r["tau_sim"], default=None)

    def _keep(self, path: Path, best: Optional[dict], start_step: int) -> bool:
        """Whether the recorded ``best`` stays the best on a resume: under sim_accept while its weights are on disk,
        also when taken after the checkpoint resumed from; else when not after it; never after this run's end."""
        keep = best is not None and (
            (self.dir / BEST_FILE).is_file() if self.keep_best else int(best["step"]) <= start_step
        )
        if keep and self.end_step is not None and int(best["step"]) > self.end_step:
            log.info(
                "%s: the best validation so far, step %d, comes after this run's end (step %d): not kept; "
                "the best is taken from this run's validations",
                path,
                int(best["step"]),
                self.end_step,
            )
            return False
        return keep

    def _sampling(self) -> tuple[float, float]:
        """``(temperature, top_p)`` the curve is scored at; top-p is 1 at temperature 0 (greedy ignores it)."""
        return (self.temperature, self.top_p) if self.temperature > 0 else (0.0, 1.0)

    def meter(self, ttt_length: int) -> Optional[SampledAcceptance]:
        """A fresh :class:`SampledAcceptance` for one validation at temperature > 0 (every rank, also one that
        tracks nothing: the sums are reduced over ranks); None at temperature 0."""
        if self.temperature <= 0:
            return None
        return SampledAcceptance(ttt_length, self.temperature, self.top_p)

    def _score(self, row: dict) -> dict:
        row = dict(row)
        row["tau_sim"] = simulated_tau(row["alpha"], self.chain)
        return row

    def update(self, step: int, epoch: int, val: dict, drafter: nn.Module) -> bool:
        """Record the validation at ``step``; save ``drafter``'s trainable tensors when it is the best so far.

        Returns:
            True when this validation is the new best (strictly higher ``tau_sim``; ties keep the earlier one, except
            that the same step measured again replaces a best kept from before a resume, ``before_resume``).
        """
        alpha = position_acceptance(val, SAMPLED_KEY if self.temperature > 0 else "acc")
        if not self.enabled or not alpha:
            return False
        row = {
            "step": int(step),
            "epoch": int(epoch),
            "alpha": [round(a, 6) for a in alpha],
            "loss": val.get("loss"),
        }
        if self.temperature > 0:
            row["alpha_top1"] = [round(a, 6) for a in position_acceptance(val)]
        row = self._score(row)
        row["tau_sim_all"] = {
            str(k): round(simulated_tau(alpha, k), 6)
            for k in sorted({1, 3, 7, len(alpha)})
            if k <= len(alpha)
        }
        self.rows = [r for r in self.rows if r["step"] != row["step"]] + [row]
        old = self.best
        is_best = old is None or row["tau_sim"] > old["tau_sim"]
        if old is not None and old.get("before_resume") and old["step"] == row["step"]:
            # the same step measured again at least as high (a deterministic rerun): the weights are this run's
            is_best = row["tau_sim"] >= old["tau_sim"]
        if is_best:
            if self.keep_best:
                state = dict(step=int(step), tau_sim=row["tau_sim"], chain=self.chain, row=row)
                state["model"] = ckpt.trainable_state(drafter)
                atomic_torch_save(state, self.dir / BEST_FILE)
            self.best = dict(row)
        atomic_write_json(self.dir / CURVE_FILE, self.summary())
        return is_best

    def summary(self) -> dict:
        """``{chain, formula, source, best: row | None, rows: [...]}`` (what ``sim_accept.json`` holds), with
        ``temperature`` and ``top_p`` at temperature > 0."""
        out = {
            "chain": self.chain,
            "formula": "tau_sim(k) = 1 + sum_{m=1..k} prod_{j<=m} alpha_j, alpha_j = held-out "
            "top-1 of TTT position j",
            "source": "TorchSpec eagle3_trainer.py / SpecForge eval/evaluator.py "
            "simulated_acc_len (+1 for the bonus token)",
            "best": self.best,
            "rows": self.rows,
        }
        if self.temperature > 0:
            out["formula"] = (
                "tau_sim(k) = 1 + sum_{m=1..k} prod_{j<=m} alpha_j, alpha_j = held-out mean of "
                "sum_x min(p_T(x), q_T(x)) at TTT position j (speculative rejection sampling)"
            )
            out["source"] += (
                "; alpha at T > 0: Leviathan et al. 2023 (arXiv 2211.17192), section 3.1"
            )
            out.update(temperature=self.temperature, top_p=self.top_p)
        return out

    def restore_best(self, drafter: nn.Module) -> Optional[int]:
        """Load the best weights into ``drafter`` (in place); returns their step, or None when nothing was saved.

        Raises:
            UserError: the best file is unreadable or its tensors do not fit the drafter.
        """
        path = self.dir / BEST_FILE
        if not self.enabled or self.best is None or not path.is_file():
            return None
        return _load_best_into(path, drafter, "delete the file and re-run")

    def plot(self) -> None:
        """``sim_accept.png``: tau_sim(chain) per validation step, the best one marked."""
        if not self.enabled or not self.rows:
            return
        rows = sorted(self.rows, key=lambda r: r["step"])
        xy = ([r["step"] for r in rows], [r["tau_sim"] for r in rows])
        series = [(*xy, "o-", {"label": f"tau_sim({self.chain})"})]
        best = self.best
        if best is not None:
            series.append(
                ([best["step"]], [best["tau_sim"]], "r*", dict(markersize=14, label="best"))
            )
        png = step_png("simulated acceptance length (validation)", *series)
        atomic_write_bytes(self.dir / PLOT_FILE, png)


def step_png(ylabel: str, *series: tuple) -> bytes:
    """PNG bytes of a 6 x 4 in. figure (Agg) of ``(steps, values, fmt, plot kwargs)`` series over optimizer steps,
    with axis labels and a legend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for x, y, fmt, kw in series:
        ax.plot(x, y, fmt, **kw)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel)
    ax.legend()
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def _best_file_row(path: Path, curve_best: Optional[dict]) -> Optional[dict]:
    """The best row to resume with when ``best_drafter.pt`` exists: the curve's (``curve_best``), unless the file holds
    another step's weights (a kill between :meth:`BestTracker.update`'s two writes: the file, written first, is the
    newer best) and records its row (key ``row``); read memory-mapped, so the tensors are not loaded. A file that does
    not read keeps the curve's row (the export then names the file in its error).
    """
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # noqa: BLE001 - restore_best / the export report an unusable file in one line
        return curve_best
    row = state.get("row") if isinstance(state, dict) else None
    if not isinstance(row, dict) or "step" not in row or "alpha" not in row:
        return curve_best  # written before the file recorded its row
    if curve_best is not None and int(curve_best["step"]) == int(row["step"]):
        return curve_best
    named = (
        f"the best {CURVE_FILE} names"
        if curve_best is not None
        else f"{CURVE_FILE}, which was not written"
    )
    log.info(
        "%s: holds the weights of step %s, newer than %s; taking that step as the best",
        path,
        row["step"],
        named,
    )
    return dict(row)


def _load_best_into(path: Path, drafter: nn.Module, fix: str, curve: Optional[Path] = None) -> int:
    """Copy ``best_drafter.pt``'s tensors into ``drafter`` (in place); returns their step. ``curve``: the run's
    ``sim_accept.json``, whose best step (or the file's own row, :func:`_best_file_row`) the file must hold.

    Raises:
        UserError: ``<why the file is not usable>; <fix>`` (:func:`_best_problem`); nothing is copied then.
    """
    params = dict(drafter.named_parameters())
    state, problem = _best_problem(path, params, curve)
    if problem:
        raise UserError(f"{problem}; {fix}")
    with torch.no_grad():
        for name, t in state["model"].items():
            params[name].copy_(t.to(params[name].device, params[name].dtype))
    return int(state["step"])


def _best_problem(
    path: Path, params: dict[str, torch.Tensor], curve: Optional[Path]
) -> tuple[Any, Optional[str]]:
    """``(state, why it cannot be loaded)`` of the best file ``path`` for the drafter of ``params``: unreadable
    (:func:`eagle3.io.read.safe_torch_load`'s line), key ``step`` / ``model`` missing, a tensor the drafter has not
    or of another shape (named), or (``curve`` given) another step than the one ``curve`` names as the best; ``why``
    None when it loads."""
    try:
        state = safe_torch_load(path)
    except UserError as e:
        return None, str(e)
    missing = [k for k in ("step", "model") if not isinstance(state, dict) or k not in state]
    if missing:
        return state, f"{path}: key '{missing[0]}' missing"
    misfit = [n for n, t in state["model"].items() if n not in params or params[n].shape != t.shape]
    if misfit:
        return state, f"{path}: tensor '{misfit[0]}' does not fit the drafter"
    summary = read_json(curve) if curve is not None and curve.is_file() else None
    best = summary.get("best") if isinstance(summary, dict) else None
    # a kill between the file and the curve: the file's own row is the newer best
    best = _best_file_row(path, best) if isinstance(best, dict) else None
    step = int(state["step"])
    if best is not None and int(best.get("step", -1)) != step:
        return state, (
            f"{path}: holds the weights of step {step}, but {curve} names step {best.get('step')} as the "
            "best"
        )
    return state, None


def load_best_for_export(
    train_dir: Path, drafter: nn.Module, ckpt_step: int
) -> tuple[Optional[int], Optional[str]]:
    """``04 --export-only`` under ``train.select_best: sim_accept``: the weights the finished training exported, read
    without changing anything in ``train_dir`` (unlike :class:`BestTracker`), whatever checkpoint gave the shape.
    ``best_drafter.pt`` present: its tensors are loaded into ``drafter``; it must load, fit, and be the step
    ``sim_accept.json`` names as the best or record its own row (:func:`_best_file_row`). Absent (``select_best:
    last``, no validation split, or never validated): ``drafter`` keeps the checkpoint's weights, with a warning.

    Args:
        train_dir: the run's ``train.output_dir``.
        drafter: holds the checkpoint's weights (step ``ckpt_step``); overwritten in place with the best ones.
        ckpt_step: the checkpoint's step (for the messages).

    Returns:
        ``(best step, None)`` when the best weights were loaded, ``(None, warning)`` when there are none.

    Raises:
        UserError: ``best_drafter.pt`` unreadable / not fitting / not the step the curve names.
    """
    path, curve = Path(train_dir) / BEST_FILE, Path(train_dir) / CURVE_FILE
    if not path.is_file():
        return None, (
            f"train.select_best: sim_accept, but {path} does not exist (trained with select_best: last, "
            f"without a validation split, or not validated yet); exporting the checkpoint's weights "
            f"(step {ckpt_step}) instead"
        )
    fix = f"set train.select_best=last to export the checkpoint (step {ckpt_step}) instead"
    step = _load_best_into(path, drafter, fix, curve)
    log.info(
        "export: the best validation's weights, step %d (%s; checkpoint step %d gave the shape)",
        step,
        path.name,
        ckpt_step,
    )
    return step, None


def markdown_lines(summary: dict) -> list[str]:
    """Markdown of a run's curve (``BestTracker.summary()`` + ``select_best`` / ``exported_step``; ``stopped``: a
    run stopped before its export, whose exported step is None)."""
    k = summary["chain"]
    best = summary.get("best") or {}
    sel, exported = summary.get("select_best", "last"), summary.get("exported_step")
    if exported is not None:
        what = str(exported)
    elif summary.get("stopped"):  # no export yet: say what 04 --export-only will export
        what = (
            f"none yet; `--export-only` exports step {best['step']}, the best"
            if sel == "sim_accept" and best
            else "none yet; `--export-only` exports the checkpoint"
        )
    else:
        what = "the last"
    if not summary.get("rows"):  # stopped before the first validation: one line, no empty table
        return [
            f"Simulated acceptance length on the validation split, tau_sim({k}): not measured (no validation ran "
            f"before the run stopped; select_best: {sel}; exported step: {what})."
        ]
    t = summary.get("temperature") or 0
    at = (
        f" at temperature {t:g}, top-p {summary.get('top_p', 1.0):g} (alpha_j = mean of sum_x min(p_T, q_T), "
        f"the acceptance probability of rejection sampling)"
        if t
        else ""
    )
    lines = [
        f"Simulated acceptance length on the validation split, tau_sim({k}) = 1 + sum_m prod_(j<=m) alpha_j{at} "
        f"(select_best: {sel}; exported step: {what}):",
        "",
        f"| step | tau_sim({k}) | "
        + "".join(f"alpha_{j} | " for j in range(1, k + 1))
        + "val loss |",
        "|---:|---:|" + "---:|" * (k + 1),
    ]
    shown = best.get("step") if not best.get("before_resume") else None  # marked (best)
    for r in sorted(summary["rows"], key=lambda r: r["step"]):
        # alpha_1..alpha_k: the ones tau_sim(k) uses
        a = "".join(f"{x:.4f} | " for x in list(r["alpha"])[:k]) + "- | " * (k - len(r["alpha"]))
        mark = " (best)" if r["step"] == shown else ""
        loss = f"{r['loss']:.4f}" if isinstance(r.get("loss"), (int, float)) else "-"
        lines.append(f"| {r['step']}{mark} | {r['tau_sim']:.4f} | {a}{loss} |")
    if best.get("before_resume"):
        lines += [
            "",
            f"Best: step {best['step']} before the resume (tau_sim({k}) {best['tau_sim']:.4f}, validated after "
            f"the checkpoint the run was resumed from, before it stopped; its weights are in {BEST_FILE} and no "
            f"validation since scored higher).",
        ]
    return lines
