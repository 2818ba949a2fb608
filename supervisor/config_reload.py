"""`ModelService/HandleReloadConfigRequest`: a ModelServerConfig for the pool's model, sent by a
client through the front door, applied by the controller (its policies and models at once, as
a changed `--model_config_file` is), and answered once it has taken effect: every version the
new policy wants is AVAILABLE, or could not load, and every label names a version that serves.
Its labels are given only then, all together, and only if it succeeded (TF Serving swaps in
its whole label map or none of it).

The front door holds the client's call; the controller finds the request in the front door's
snapshot and answers it with the control op `reload_done` (code and message, TF Serving's
status codes). TF Serving returns from a reload of a model it already serves without waiting
for the versions, and then refuses a label on a version not yet loaded; waiting first means
a caller learns whether the change worked, and the label rule holds on the settled state.
A version that had failed before the request (END, or waiting to be tried again) is not
waited for and fails nothing: the same config asked again, or one that only moves labels
among the versions that serve, succeeds while a broken version sits on disk.
"""

from __future__ import annotations

from mpspool.supervisor.versions import VersionPolicy

OK = 0
UNKNOWN = 2
INVALID_ARGUMENT = 3
FAILED_PRECONDITION = 9
UNAVAILABLE = 14


def label_may_wait_for(label: str, version: int, told: dict[str, int], allowed: bool) -> bool:
    """Whether ``label`` may name ``version`` while that version is not AVAILABLE: only with
    --allow_version_labels_for_unavailable_models, and only for a label the front door does
    not have on another version (``told``: the labels it was last given). TF Serving's rule
    (ServerCore::UpdateModelVersionLabelMap): a new label may point ahead; a label in use
    moves only to a version that serves, so its requests never lose their version."""
    return allowed and told.get(label, version) == version


def unavailable_label(model: str, version: int) -> str:
    """TF Serving's words for a label on a version that does not serve
    (ServerCore::UpdateModelVersionLabelMap)."""
    return (
        f"Request to assign label to version {version} of model {model}, which is not "
        "currently available for inference"
    )


def no_version_fits(model: str, policy: VersionPolicy, on_disk: set[int]) -> str:
    """Why ``policy`` wants none of the versions on disk ("" when it wants one)."""
    if policy.aspired(on_disk, set()):
        return ""
    found = ", ".join(str(v) for v in sorted(on_disk)) or "none"
    return (
        f"no version of model {model} fits the version policy {policy.describe()} "
        f"(on disk: {found})"
    )


def outcome(
    model: str,
    policy: VersionPolicy,
    on_disk: set[int],
    available: set[int],
    failed: dict[int, str],
    labels: dict[str, int],
    told: dict[str, int] | None = None,
    labels_may_wait: bool = False,
    failed_before: set[int] | None = None,
) -> tuple[int, str] | None:
    """(code, message) once the pool has settled under the new config; None while a version
    the policy wants is still on its way. ``told`` and ``labels_may_wait``: see
    label_may_wait_for. ``failed_before``: versions that had failed (or were waiting to be
    tried again) before the request was asked and do not serve: passed over as the
    controller passes over a failed version, neither waited for nor reported, as TF
    Serving's ReloadConfig waits for no version of a model it already serves. A version that
    fails after (one the request newly wants, a new model's) is reported: TF Serving returns
    an added model's load error."""
    before = failed_before or set()
    wanted = policy.aspired(on_disk, before)
    could_not = sorted(v for v in wanted if v in failed)
    if could_not:
        why = "; ".join(f"version {v}: {failed[v]}" for v in could_not)
        return UNKNOWN, f"model {model} could not load {why}"
    unfit = no_version_fits(model, policy, on_disk)
    if unfit:
        return FAILED_PRECONDITION, unfit
    if wanted - available:
        return None
    waiting = {
        v
        for label, v in labels.items()
        if v not in available and not label_may_wait_for(label, v, told or {}, labels_may_wait)
    }
    if waiting:
        return FAILED_PRECONDITION, unavailable_label(model, min(waiting))
    return OK, ""
