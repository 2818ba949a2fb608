//! The served model's versions and labels, as the controller (their one owner) last said, and
//! how a request's `ModelSpec` resolves to one of them — TF Serving's rules and messages:
//! - no version: the latest AVAILABLE version ("Latest(name)");
//! - a version number: that version, if AVAILABLE ("Specific(name, v)");
//! - a label: the version the label names (`version_labels` in the model config), or a
//!   version's own number written as a label (perf_analyzer's `-x` sends it that way);
//! - anything else: NOT_FOUND, or INVALID_ARGUMENT for an unknown label.
//!
//! Until the controller says anything (`versions` on the control channel), the table holds
//! the version the pool was configured with, AVAILABLE: the pool as it was before versions
//! could change.
//!
//! A pool may serve several models (`Models`): one table each, a request goes to the one its
//! spec names. Each model has a `ModelId`, its place in the configuration's list, so that a
//! request's target and a worker's servable stay small `Copy` values on the request path.
//! The controller may add and remove models while the pool serves (`Models::serve`): an
//! added model takes the next id, a removed one keeps its id (requests already on their way
//! to it finish) and is no longer found by name.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use crate::batch::Batching;
use crate::config::ModelEntry;
use crate::proto::mpspool::tfs::{
    model_spec::VersionChoice, model_version_status, ModelSpec, ModelVersionStatus, StatusProto,
};
use crate::status::{split_status_text, Code, ServingError};

/// TF Serving's version states (`ModelVersionStatus.State`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VersionState {
    Start,
    Loading,
    Available,
    Unloading,
    End,
}

impl VersionState {
    pub fn parse(name: &str) -> Option<VersionState> {
        match name {
            "START" => Some(VersionState::Start),
            "LOADING" => Some(VersionState::Loading),
            "AVAILABLE" => Some(VersionState::Available),
            "UNLOADING" => Some(VersionState::Unloading),
            "END" => Some(VersionState::End),
            _ => None,
        }
    }

    fn proto(self) -> model_version_status::State {
        match self {
            VersionState::Start => model_version_status::State::Start,
            VersionState::Loading => model_version_status::State::Loading,
            VersionState::Available => model_version_status::State::Available,
            VersionState::Unloading => model_version_status::State::Unloading,
            VersionState::End => model_version_status::State::End,
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct VersionEntry {
    pub state: VersionState,
    /// Why a version failed to load ("" when it did not), as the controller words it: its
    /// status code first when it has one ("NOT_FOUND: ...", `split_status_text`).
    pub error: String,
    /// With `--enable_per_model_batching_parameters`: the version's own batching, from the
    /// `batching_params.pbtxt` in its directory (read by the controller); None: its requests
    /// are not merged, as TF Serving does not batch a version without that file.
    pub batching: Option<Arc<Batching>>,
    /// With it too: the rows above which the version's requests are cut into pieces (its
    /// file's `enable_large_batch_splitting`; 0: not cut).
    pub split_rows: u64,
}

/// A model's place in the pool's list of models (pool.json's `models`, in order).
pub type ModelId = u16;

/// One version of one model: what a group of workers serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Servable {
    pub model: ModelId,
    pub version: i64,
}

/// Where a request goes: a model's version, and whether the client named the version. A
/// request that did not name one may move to the newest version of its model if its own
/// retires before it is sent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Target {
    pub model: ModelId,
    pub version: i64,
    pub pinned: bool,
}

impl Target {
    pub fn servable(self) -> Servable {
        Servable {
            model: self.model,
            version: self.version,
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct VersionTable {
    pub id: ModelId,
    pub model: String,
    pub versions: BTreeMap<i64, VersionEntry>,
    pub labels: BTreeMap<String, i64>,
    /// Whether the controller has spoken (until then: the configured version only).
    pub from_controller: bool,
    /// A model the pool started with that has not served yet (the controller's word): while
    /// its first version loads, its requests are UNAVAILABLE (`first_still_loading`).
    pub starting: bool,
}

impl VersionTable {
    pub fn configured(id: ModelId, model: &str, version: i64) -> VersionTable {
        let available = VersionEntry {
            state: VersionState::Available,
            error: String::new(),
            batching: None,
            split_rows: 0,
        };
        VersionTable {
            id,
            model: model.to_string(),
            versions: BTreeMap::from([(version, available)]),
            labels: BTreeMap::new(),
            from_controller: false,
            starting: false,
        }
    }

    /// The table of a model added while the pool serves, until the controller's own comes:
    /// its first version LOADING, so that its requests get NOT_FOUND as in TF Serving (as
    /// AVAILABLE they reached no worker and got UNAVAILABLE "still loading"; found by a hunt).
    pub fn added(id: ModelId, model: &str, version: i64) -> VersionTable {
        let mut table = VersionTable::configured(id, model, version);
        for entry in table.versions.values_mut() {
            entry.state = VersionState::Loading;
        }
        table
    }

    /// The newest AVAILABLE version.
    pub fn latest(&self) -> Option<i64> {
        self.versions
            .iter()
            .rev()
            .find(|(_, e)| e.state == VersionState::Available)
            .map(|(v, _)| *v)
    }

    pub fn available(&self, version: i64) -> bool {
        self.versions
            .get(&version)
            .is_some_and(|e| e.state == VersionState::Available)
    }

    /// UNAVAILABLE for a request this model cannot serve yet because the pool is starting
    /// and its first version is still loading (`starting`; none AVAILABLE, `version` or, for
    /// the latest, some version START or LOADING). TF Serving opens its ports only once the
    /// models it starts with are loaded, so its clients meet "connection refused" then,
    /// which they take as UNAVAILABLE and retry (and `wait_for_ready` waits out); a front
    /// door listening from the start that said NOT_FOUND would fail every client started
    /// beside the pool. Otherwise TF Serving's answers stand: NOT_FOUND for a version still
    /// loading beside one that serves, or for a model added while the pool serves.
    fn first_still_loading(&self, version: Option<i64>) -> Option<ServingError> {
        if !self.starting || self.latest().is_some() {
            return None;
        }
        let loading =
            |e: &VersionEntry| matches!(e.state, VersionState::Start | VersionState::Loading);
        let waiting = match version {
            Some(v) => self.versions.get(&v).filter(|e| loading(e)).map(|_| v),
            None => self
                .versions
                .iter()
                .rev()
                .find(|(_, e)| loading(e))
                .map(|(v, _)| *v),
        }?;
        Some(ServingError::new(
            Code::Unavailable,
            format!("model {} version {waiting} is still loading", self.model),
        ))
    }

    /// The version a Predict, Classify, Regress, MultiInference or GetModelMetadata runs on.
    pub fn resolve(&self, spec: Option<&ModelSpec>) -> Result<Target, ServingError> {
        let Some(spec) = spec.filter(|s| !s.name.is_empty()) else {
            return Err(ServingError::invalid_argument(
                "ModelSpec has no name specified.",
            ));
        };
        let not_found = |wanted: String| {
            ServingError::new(
                Code::NotFound,
                format!("Servable not found for request: {wanted}"),
            )
        };
        // What this model cannot serve: still loading at the pool's start, else not found.
        let unservable = |version: Option<i64>, wanted: String| {
            (spec.name == self.model)
                .then(|| self.first_still_loading(version))
                .flatten()
                .unwrap_or_else(|| not_found(wanted))
        };
        let specific = |v: i64| unservable(Some(v), format!("Specific({}, {v})", spec.name));
        match &spec.version_choice {
            Some(VersionChoice::Version(v)) => {
                if spec.name != self.model || !self.available(*v) {
                    return Err(specific(*v));
                }
                Ok(Target {
                    model: self.id,
                    version: *v,
                    pinned: true,
                })
            }
            Some(VersionChoice::VersionLabel(label)) => {
                if spec.name != self.model {
                    return Err(not_found(format!("Latest({})", spec.name)));
                }
                let version = self.label(label)?;
                if !self.available(version) {
                    return Err(specific(version));
                }
                Ok(Target {
                    model: self.id,
                    version,
                    pinned: true,
                })
            }
            None => {
                let latest = self.latest().filter(|_| spec.name == self.model);
                let version =
                    latest.ok_or_else(|| unservable(None, format!("Latest({})", spec.name)))?;
                Ok(Target {
                    model: self.id,
                    version,
                    pinned: false,
                })
            }
        }
    }

    fn label(&self, label: &str) -> Result<i64, ServingError> {
        if let Some(version) = self.labels.get(label) {
            return Ok(*version);
        }
        match label.parse::<i64>() {
            Ok(version) if self.versions.contains_key(&version) => Ok(version),
            _ => Err(ServingError::invalid_argument(format!(
                "Unrecognized servable version label: {label}"
            ))),
        }
    }

    /// GetModelStatus (TF Serving's GetModelStatusImpl): every version the pool knows, or
    /// the one the spec names. `up(v)`: whether version v has a worker and its signatures
    /// (before the controller speaks, that is what makes the configured version AVAILABLE).
    pub fn status(
        &self,
        spec: Option<&ModelSpec>,
        up: impl Fn(i64) -> bool,
    ) -> Result<Vec<ModelVersionStatus>, ServingError> {
        let spec = spec_given(spec)?;
        // As TF Serving's GetModelStatusImpl: a label is not looked at (all versions).
        let wanted = match &spec.version_choice {
            Some(VersionChoice::Version(v)) => Some(*v),
            _ => None,
        };
        if spec.name != self.model && wanted.is_none() {
            return Err(ServingError::new(
                Code::NotFound,
                format!("Could not find any versions of model {}", spec.name),
            ));
        }
        if let Some(v) =
            wanted.filter(|v| spec.name != self.model || !self.versions.contains_key(v))
        {
            return Err(ServingError::new(
                Code::NotFound,
                format!("Could not find version {v} of model {}", spec.name),
            ));
        }
        Ok(self
            .versions
            .iter()
            .rev()
            .filter(|(v, _)| wanted.is_none_or(|w| w == **v))
            .map(|(version, entry)| {
                let state = match entry.state {
                    VersionState::Available if !self.from_controller && !up(*version) => {
                        VersionState::Loading
                    }
                    state => state,
                };
                let status = if entry.error.is_empty() {
                    StatusProto::default()
                } else {
                    // TF Serving's: the code and message of the load's failure.
                    let (code, message) = split_status_text(&entry.error);
                    StatusProto {
                        error_code: code as i32,
                        error_message: message.to_string(),
                    }
                };
                ModelVersionStatus {
                    version: *version,
                    state: state.proto() as i32,
                    status: Some(status),
                }
            })
            .collect())
    }

    /// The table the controller sent: `versions` a list of {version, state, error}, `labels`
    /// a map of label → version. A label may name a version not listed (with
    /// --allow_version_labels_for_unavailable_models, one not on disk yet): its requests get
    /// NOT_FOUND for that version until it serves, as in TF Serving.
    pub fn from_control(
        id: ModelId,
        model: &str,
        versions: &[rmpv::Value],
        labels: Option<&rmpv::Value>,
    ) -> Result<VersionTable, String> {
        let mut table = VersionTable {
            id,
            model: model.to_string(),
            versions: BTreeMap::new(),
            labels: BTreeMap::new(),
            from_controller: true,
            starting: false,
        };
        for entry in versions {
            let get = |name: &str| {
                entry.as_map().and_then(|m| {
                    m.iter()
                        .find(|(k, _)| k.as_str() == Some(name))
                        .map(|(_, v)| v)
                })
            };
            let version = get("version").and_then(rmpv::Value::as_i64);
            let state = get("state")
                .and_then(rmpv::Value::as_str)
                .and_then(VersionState::parse);
            let (Some(version), Some(state)) = (version, state) else {
                return Err(
                    "each version needs version and state (START, LOADING, AVAILABLE, \
                     UNLOADING or END)"
                        .to_string(),
                );
            };
            let error = get("error")
                .and_then(rmpv::Value::as_str)
                .unwrap_or("")
                .to_string();
            let (batching, split_rows) = match get("batching") {
                None | Some(rmpv::Value::Nil) => (None, 0),
                Some(given) => {
                    let (batching, split_rows) = version_batching(given)
                        .map_err(|error| format!("version {version}'s batching: {error}"))?;
                    (Some(Arc::new(batching)), split_rows)
                }
            };
            let entry = VersionEntry {
                state,
                error,
                batching,
                split_rows,
            };
            table.versions.insert(version, entry);
        }
        match labels {
            None | Some(rmpv::Value::Nil) => {}
            Some(rmpv::Value::Map(entries)) => {
                for (label, version) in entries {
                    let (Some(label), Some(version)) = (label.as_str(), version.as_i64()) else {
                        return Err("labels maps a label to a version number".to_string());
                    };
                    table.labels.insert(label.to_string(), version);
                }
            }
            Some(_) => return Err("labels maps a label to a version number".to_string()),
        }
        Ok(table)
    }
}

/// A version's batching as the controller sends it (mpspool/config.py, `version_batching`):
/// TF Serving's parameters and the rows above which requests are cut, checked by TF
/// Serving's rules (`Batching::check`).
fn version_batching(given: &rmpv::Value) -> Result<(Batching, u64), String> {
    let Some(map) = given.as_map() else {
        return Err("a map of TF Serving's batching parameters".to_string());
    };
    let field = |name: &str| {
        map.iter()
            .find(|(key, _)| key.as_str() == Some(name))
            .map(|(_, value)| value)
    };
    let number = |name: &str| {
        field(name)
            .and_then(rmpv::Value::as_u64)
            .ok_or_else(|| format!("{name} must be a number >= 0"))
    };
    let allowed_batch_sizes = match field("allowed_batch_sizes") {
        None | Some(rmpv::Value::Nil) => Vec::new(),
        Some(rmpv::Value::Array(sizes)) => sizes
            .iter()
            .map(rmpv::Value::as_u64)
            .collect::<Option<Vec<u64>>>()
            .ok_or("allowed_batch_sizes must be numbers >= 0")?,
        Some(_) => return Err("allowed_batch_sizes must be a list".to_string()),
    };
    let batching = Batching {
        max_batch_size: number("max_batch_size")?,
        timeout: Duration::from_micros(number("batch_timeout_micros")?),
        allowed_batch_sizes,
        max_enqueued_batches: number("max_enqueued_batches")?,
    };
    batching.check()?;
    let split_rows = match field("split_rows") {
        None | Some(rmpv::Value::Nil) => 0,
        Some(_) => number("split_rows")?,
    };
    Ok((batching, split_rows))
}

/// Every model the pool serves, each with its version table; never empty (the configuration
/// lists at least one model).
#[derive(Clone, Debug, PartialEq)]
pub struct Models {
    tables: Vec<VersionTable>,
    /// Models the controller removed: kept for their ids, never found by name for a call;
    /// GetModelStatus still lists their versions, all END (TF Serving's state monitor keeps
    /// an unloaded servable's last state).
    removed: BTreeSet<ModelId>,
}

impl Models {
    /// The configured models, in order (a model's index is its `ModelId`), each at the
    /// version it was configured with (served until the controller lists versions). None
    /// when the list is empty or longer than `ModelId` counts.
    pub fn configured(models: &[ModelEntry]) -> Option<Models> {
        if models.is_empty() {
            return None;
        }
        let tables = models
            .iter()
            .enumerate()
            .map(|(id, m)| {
                ModelId::try_from(id)
                    .ok()
                    .map(|id| VersionTable::configured(id, &m.name, m.version))
            })
            .collect::<Option<Vec<_>>>()?;
        Some(Models {
            tables,
            removed: BTreeSet::new(),
        })
    }

    /// The models served now, in order.
    pub fn iter(&self) -> impl Iterator<Item = &VersionTable> {
        self.tables.iter().filter(|t| !self.removed.contains(&t.id))
    }

    /// A model by id, served or removed (its name stays known for what is on its way).
    pub fn get(&self, id: ModelId) -> Option<&VersionTable> {
        self.tables.get(usize::from(id))
    }

    pub fn is_served(&self, id: ModelId) -> bool {
        usize::from(id) < self.tables.len() && !self.removed.contains(&id)
    }

    /// Every model id ever given in this process, served or removed.
    pub fn ids(&self) -> impl Iterator<Item = (ModelId, &str)> {
        self.tables.iter().map(|t| (t.id, t.model.as_str()))
    }

    pub fn named(&self, name: &str) -> Option<&VersionTable> {
        self.iter().find(|t| t.model == name)
    }

    /// The controller's list of the models to serve from now on, in order: models not yet
    /// served are added (a new id, or the id they had before they were removed) at the
    /// version listed, served models missing from the list are removed. The first model
    /// stays the first (the pool's model: names no other model answers fall to it). What
    /// changed, or why nothing did.
    pub fn serve(&mut self, listed: &[ModelEntry]) -> Result<Vec<String>, String> {
        let first = &self.tables[0].model;
        if listed.first().map(|m| &m.name) != Some(first) {
            return Err(format!(
                "models must list the pool's first model {first} first"
            ));
        }
        for (i, entry) in listed.iter().enumerate() {
            if entry.name.is_empty() || listed[..i].iter().any(|m| m.name == entry.name) {
                return Err(format!(
                    "models: each needs a name of its own, not {:?}",
                    entry.name
                ));
            }
        }
        let new = listed
            .iter()
            .filter(|m| !self.tables.iter().any(|t| t.model == m.name))
            .count();
        if self.tables.len() + new > usize::from(ModelId::MAX) {
            return Err(format!("a pool serves at most {} models", ModelId::MAX));
        }
        let mut changed = Vec::new();
        for entry in listed {
            match self.tables.iter().position(|t| t.model == entry.name) {
                Some(at) => {
                    let id = self.tables[at].id;
                    if self.removed.remove(&id) {
                        self.tables[at] = VersionTable::added(id, &entry.name, entry.version);
                        changed.push(format!("{} served again", entry.name));
                    }
                }
                None => {
                    let Ok(id) = ModelId::try_from(self.tables.len()) else {
                        return Err(format!("a pool serves at most {} models", ModelId::MAX));
                    };
                    let table = VersionTable::added(id, &entry.name, entry.version);
                    self.tables.push(table);
                    changed.push(format!("{} added", entry.name));
                }
            }
        }
        for table in &mut self.tables {
            if !self.removed.contains(&table.id) && !listed.iter().any(|m| m.name == table.model) {
                self.removed.insert(table.id);
                // UNLOADING while its workers drain, as TF Serving's state monitor says
                // before it unloads; END once the controller says they ended (`ended`).
                for entry in table.versions.values_mut() {
                    if entry.state != VersionState::End {
                        entry.state = VersionState::Unloading;
                    }
                }
                changed.push(format!("{} removed", table.model));
            }
        }
        Ok(changed)
    }

    /// The removed models not `draining` (their workers, as the controller last said, have
    /// all ended): their versions END. What changed.
    pub fn ended(&mut self, draining: &[String]) -> Vec<String> {
        let mut changed = Vec::new();
        for table in &mut self.tables {
            let removed = self.removed.contains(&table.id);
            let unloading = (table.versions.values()).any(|v| v.state != VersionState::End);
            if removed && unloading && !draining.contains(&table.model) {
                for entry in table.versions.values_mut() {
                    entry.state = VersionState::End;
                }
                changed.push(format!("{} ended", table.model));
            }
        }
        changed
    }

    /// The table a spec is answered from: its model's, or — for a name the pool does not
    /// serve — the first one, whose own rules then say NOT_FOUND in TF Serving's words.
    fn for_spec(&self, spec: Option<&ModelSpec>) -> &VersionTable {
        spec.and_then(|s| self.named(&s.name))
            .unwrap_or(&self.tables[0])
    }

    /// `VersionTable::resolve` on the model the spec names.
    pub fn resolve(&self, spec: Option<&ModelSpec>) -> Result<Target, ServingError> {
        self.for_spec(spec).resolve(spec)
    }

    /// `VersionTable::status` on the model the spec names, served or removed (a removed
    /// model's versions are END, as TF Serving answers once it unloaded them); `up` is asked
    /// per servable.
    pub fn status(
        &self,
        spec: Option<&ModelSpec>,
        up: impl Fn(Servable) -> bool,
    ) -> Result<Vec<ModelVersionStatus>, ServingError> {
        // Names are unique across the tables: a model served again takes its old table.
        let table = spec
            .and_then(|s| self.tables.iter().find(|t| t.model == s.name))
            .unwrap_or(&self.tables[0]);
        table.status(spec, |version| {
            up(Servable {
                model: table.id,
                version,
            })
        })
    }

    /// Each served model's newest AVAILABLE version.
    pub fn latest(&self) -> BTreeMap<ModelId, i64> {
        self.iter()
            .filter_map(|t| Some((t.id, t.latest()?)))
            .collect()
    }

    /// The controller's new table for one model (`from_control` made it with that model's
    /// id); false when no such model is served.
    pub fn replace(&mut self, table: VersionTable) -> bool {
        if self.removed.contains(&table.id) {
            return false;
        }
        match self.tables.get_mut(usize::from(table.id)) {
            Some(slot) if slot.model == table.model => {
                *slot = table;
                true
            }
            _ => false,
        }
    }
}

/// A request's `model_spec`, or TF Serving's refusal of a request without one (its Predict,
/// Classify, Regress, GetModelMetadata and GetModelStatus check `has_model_spec()` first; a
/// MultiInference task's spec is read as given, an empty one naming no model).
pub fn spec_given(spec: Option<&ModelSpec>) -> Result<&ModelSpec, ServingError> {
    spec.ok_or_else(|| ServingError::invalid_argument("Missing ModelSpec"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(name: &str, choice: Option<VersionChoice>) -> ModelSpec {
        ModelSpec {
            name: name.to_string(),
            version_choice: choice,
            signature_name: String::new(),
        }
    }

    fn table() -> VersionTable {
        let versions = [
            rmpv::Value::Map(vec![
                ("version".into(), 1.into()),
                ("state".into(), "UNLOADING".into()),
            ]),
            rmpv::Value::Map(vec![
                ("version".into(), 2.into()),
                ("state".into(), "AVAILABLE".into()),
            ]),
            rmpv::Value::Map(vec![
                ("version".into(), 3.into()),
                ("state".into(), "END".into()),
                ("error".into(), "cannot load: no variables".into()),
            ]),
        ];
        let labels = rmpv::Value::Map(vec![("stable".into(), 2.into()), ("old".into(), 1.into())]);
        VersionTable::from_control(0, "demo", &versions, Some(&labels)).unwrap()
    }

    fn target(v: i64, pinned: bool) -> Target {
        Target {
            model: 0,
            version: v,
            pinned,
        }
    }

    #[test]
    fn requests_resolve_as_tf_serving_resolves_them() {
        let t = table();
        assert_eq!(t.latest(), Some(2));
        assert_eq!(t.resolve(Some(&spec("demo", None))), Ok(target(2, false)));
        let v = |v| Some(VersionChoice::Version(v));
        let l = |l: &str| Some(VersionChoice::VersionLabel(l.to_string()));
        assert_eq!(t.resolve(Some(&spec("demo", v(2)))), Ok(target(2, true)));
        assert_eq!(
            t.resolve(Some(&spec("demo", l("stable")))),
            Ok(target(2, true))
        );
        assert_eq!(t.resolve(Some(&spec("demo", l("2")))), Ok(target(2, true)));
        let not_found = |m: &str| Err(ServingError::new(Code::NotFound, m));
        // Retiring, failed or unknown versions take no new requests.
        for version in [1, 3, 7] {
            assert_eq!(
                t.resolve(Some(&spec("demo", v(version)))),
                not_found(&format!(
                    "Servable not found for request: Specific(demo, {version})"
                ))
            );
        }
        assert_eq!(
            t.resolve(Some(&spec("demo", l("old")))),
            not_found("Servable not found for request: Specific(demo, 1)")
        );
        assert_eq!(
            t.resolve(Some(&spec("demo", l("canary")))),
            Err(ServingError::invalid_argument(
                "Unrecognized servable version label: canary"
            ))
        );
        assert_eq!(
            t.resolve(Some(&spec("other", None))),
            not_found("Servable not found for request: Latest(other)")
        );
        assert_eq!(
            t.resolve(Some(&spec("", None))),
            Err(ServingError::invalid_argument(
                "ModelSpec has no name specified."
            ))
        );
    }

    fn listed(states: &[(i64, &str)]) -> VersionTable {
        let versions: Vec<rmpv::Value> = states
            .iter()
            .map(|(version, state)| {
                rmpv::Value::Map(vec![
                    ("version".into(), (*version).into()),
                    ("state".into(), (*state).into()),
                ])
            })
            .collect();
        let mut table = VersionTable::from_control(0, "demo", &versions, None).unwrap();
        table.starting = true;
        table
    }

    /// While a model's first version loads, its requests are UNAVAILABLE (retried, as TF
    /// Serving's clients retry the refused connection of a server still loading); a version
    /// that ended, or one loading beside an AVAILABLE one, is NOT_FOUND as in TF Serving.
    #[test]
    fn nothing_available_is_unavailable_while_the_first_version_loads_else_not_found() {
        let still_loading = |v: i64| {
            Err(ServingError::new(
                Code::Unavailable,
                format!("model demo version {v} is still loading"),
            ))
        };
        let not_found = |what: &str| {
            Err(ServingError::new(
                Code::NotFound,
                format!("Servable not found for request: {what}"),
            ))
        };
        let starting = listed(&[(3, "END"), (4, "LOADING"), (5, "START")]);
        assert_eq!(
            starting.resolve(Some(&spec("demo", None))),
            still_loading(5)
        );
        assert_eq!(
            starting.resolve(Some(&spec("demo", Some(VersionChoice::Version(4))))),
            still_loading(4)
        );
        assert_eq!(
            starting.resolve(Some(&spec("demo", Some(VersionChoice::Version(3))))),
            not_found("Specific(demo, 3)")
        );
        assert_eq!(
            starting.resolve(Some(&spec("other", None))),
            not_found("Latest(other)")
        );

        let failed = listed(&[(4, "END")]);
        assert_eq!(
            failed.resolve(Some(&spec("demo", None))),
            not_found("Latest(demo)")
        );

        // A model added while the pool serves: TF Serving's ports are open then, NOT_FOUND.
        let mut added = listed(&[(4, "LOADING")]);
        added.starting = false;
        assert_eq!(
            added.resolve(Some(&spec("demo", None))),
            not_found("Latest(demo)")
        );

        let serving = listed(&[(3, "AVAILABLE"), (4, "LOADING")]);
        assert_eq!(
            serving.resolve(Some(&spec("demo", Some(VersionChoice::Version(4))))),
            not_found("Specific(demo, 4)")
        );
        assert_eq!(
            serving.resolve(Some(&spec("demo", None))).unwrap().version,
            3
        );
    }

    #[test]
    fn status_gives_a_failed_version_the_code_of_its_failure() {
        let versions = [rmpv::Value::Map(vec![
            ("version".into(), 4.into()),
            ("state".into(), "END".into()),
            (
                "error".into(),
                "NOT_FOUND: cannot load model demo: no saved_model.pb".into(),
            ),
        ])];
        let t = VersionTable::from_control(0, "demo", &versions, None).unwrap();
        let all = t.status(Some(&spec("demo", None)), |_| true).unwrap();
        let failed = all[0].status.as_ref().unwrap();
        assert_eq!(failed.error_code, Code::NotFound as i32);
        assert_eq!(
            failed.error_message,
            "cannot load model demo: no saved_model.pb"
        );
    }

    #[test]
    fn status_lists_every_version_with_its_state_and_error() {
        let t = table();
        let all = t.status(Some(&spec("demo", None)), |_| true).unwrap();
        let states: Vec<(i64, i32)> = all.iter().map(|s| (s.version, s.state)).collect();
        use model_version_status::State;
        assert_eq!(
            states,
            vec![
                (3, State::End as i32),
                (2, State::Available as i32),
                (1, State::Unloading as i32)
            ]
        );
        let failed = all[0].status.as_ref().unwrap();
        assert_eq!(failed.error_code, Code::Unknown as i32);
        assert_eq!(failed.error_message, "cannot load: no variables");
        let one = t
            .status(Some(&spec("demo", Some(VersionChoice::Version(1)))), |_| {
                true
            })
            .unwrap();
        assert_eq!(one.len(), 1);
        assert_eq!(one[0].version, 1);
        let labelled = Some(VersionChoice::VersionLabel("x".into()));
        assert_eq!(
            t.status(Some(&spec("demo", labelled)), |_| true)
                .unwrap()
                .len(),
            3
        );
        assert_eq!(
            t.status(Some(&spec("nope", Some(VersionChoice::Version(2)))), |_| {
                true
            }),
            Err(ServingError::new(
                Code::NotFound,
                "Could not find version 2 of model nope"
            ))
        );
        assert_eq!(
            t.status(Some(&spec("demo", Some(VersionChoice::Version(9)))), |_| {
                true
            }),
            Err(ServingError::new(
                Code::NotFound,
                "Could not find version 9 of model demo"
            ))
        );
        assert_eq!(
            t.status(Some(&spec("nope", None)), |_| true),
            Err(ServingError::new(
                Code::NotFound,
                "Could not find any versions of model nope"
            ))
        );
        assert_eq!(
            t.status(None, |_| true),
            Err(ServingError::invalid_argument("Missing ModelSpec"))
        );
    }

    #[test]
    fn the_configured_version_is_loading_until_it_is_up() {
        let t = VersionTable::configured(0, "demo", 5);
        assert_eq!(t.resolve(Some(&spec("demo", None))), Ok(target(5, false)));
        let state = |up: bool| t.status(Some(&spec("demo", None)), |_| up).unwrap()[0].state;
        use model_version_status::State;
        assert_eq!(state(false), State::Loading as i32);
        assert_eq!(state(true), State::Available as i32);
    }

    #[test]
    fn a_bad_table_from_the_controller_is_refused() {
        let bad_state = [rmpv::Value::Map(vec![
            ("version".into(), 1.into()),
            ("state".into(), "READY".into()),
        ])];
        assert!(VersionTable::from_control(0, "m", &bad_state, None)
            .unwrap_err()
            .contains("START, LOADING"));
        let ok = [rmpv::Value::Map(vec![
            ("version".into(), 1.into()),
            ("state".into(), "AVAILABLE".into()),
        ])];
        let not_a_number = rmpv::Value::Map(vec![("stable".into(), "two".into())]);
        assert!(VersionTable::from_control(0, "m", &ok, Some(&not_a_number))
            .unwrap_err()
            .contains("maps a label to a version number"));
    }

    #[test]
    fn a_label_ahead_of_its_version_finds_nothing_until_it_serves() {
        // --allow_version_labels_for_unavailable_models: "next" names a version not on disk.
        let ok = [rmpv::Value::Map(vec![
            ("version".into(), 1.into()),
            ("state".into(), "AVAILABLE".into()),
        ])];
        let ahead = rmpv::Value::Map(vec![("next".into(), 2.into())]);
        let t = VersionTable::from_control(0, "m", &ok, Some(&ahead)).unwrap();
        let next = Some(VersionChoice::VersionLabel("next".to_string()));
        assert_eq!(
            t.resolve(Some(&spec("m", next))),
            Err(ServingError::new(
                Code::NotFound,
                "Servable not found for request: Specific(m, 2)"
            ))
        );
    }

    #[test]
    fn models_are_added_and_removed_while_ids_stay() {
        let mut models = Models::configured(&[ModelEntry::new("wdl", 3)]).unwrap();
        let listed = [ModelEntry::new("wdl", 3), ModelEntry::new("ranker", 1)];
        assert_eq!(models.serve(&listed), Ok(vec!["ranker added".to_string()]));
        assert_eq!(
            models.serve(&listed),
            Ok(vec![]),
            "the same list again: no change"
        );
        let ranker = Some(&spec("ranker", None));
        assert!(
            models.replace(VersionTable::configured(1, "ranker", 1)),
            "its table came"
        );
        assert_eq!(
            models.resolve(ranker).map(|t| (t.model, t.version)),
            Ok((1, 1))
        );

        // Removed: not found by name, no latest, no new table from the controller; its id
        // keeps its name for what is on its way.
        assert_eq!(
            models.serve(&[ModelEntry::new("wdl", 3)]),
            Ok(vec!["ranker removed".to_string()])
        );
        assert_eq!(
            models.resolve(ranker),
            Err(ServingError::new(
                Code::NotFound,
                "Servable not found for request: Latest(ranker)"
            ))
        );
        assert!(!models.is_served(1) && models.get(1).is_some_and(|t| t.model == "ranker"));
        assert_eq!(models.latest(), BTreeMap::from([(0, 3)]));
        // GetModelStatus still knows it: its versions UNLOADING while its workers drain,
        // then END, as TF Serving's state monitor (END at once made a script that waits for
        // END and adds the model back find it still being removed; found by a hunt).
        let states = |models: &Models, spec: &ModelSpec| {
            models
                .status(Some(spec), |_| true)
                .map(|all| all.iter().map(|s| (s.version, s.state)).collect::<Vec<_>>())
        };
        let unloading = model_version_status::State::Unloading as i32;
        assert_eq!(
            states(&models, &spec("ranker", None)),
            Ok(vec![(1, unloading)])
        );
        assert!(
            models.ended(&["ranker".to_string()]).is_empty(),
            "still draining"
        );
        assert_eq!(models.ended(&[]), vec!["ranker ended".to_string()]);
        assert!(models.ended(&[]).is_empty());
        let end = model_version_status::State::End as i32;
        assert_eq!(states(&models, &spec("ranker", None)), Ok(vec![(1, end)]));
        let one = spec("ranker", Some(VersionChoice::Version(1)));
        assert_eq!(states(&models, &one), Ok(vec![(1, end)]));
        let two = spec("ranker", Some(VersionChoice::Version(2)));
        assert_eq!(
            states(&models, &two),
            Err(ServingError::new(
                Code::NotFound,
                "Could not find version 2 of model ranker"
            ))
        );
        assert!(!models.replace(VersionTable::configured(1, "ranker", 2)));
        assert_eq!(models.iter().count(), 1);

        // Back, at its old id, at the version listed; another model takes the next id.
        let listed = [
            ModelEntry::new("wdl", 3),
            ModelEntry::new("ranker", 2),
            ModelEntry::new("tower", 5),
        ];
        assert_eq!(
            models.serve(&listed),
            Ok(vec![
                "ranker served again".to_string(),
                "tower added".to_string()
            ])
        );
        // LOADING until the controller's table comes: NOT_FOUND, as TF Serving answers a
        // model added while it serves (AVAILABLE, its requests found no worker).
        let loading = model_version_status::State::Loading as i32;
        assert_eq!(
            states(&models, &spec("ranker", None)),
            Ok(vec![(2, loading)])
        );
        let tower = Some(&spec("tower", None));
        for added in [ranker, tower] {
            let refused = models.resolve(added).map(|t| (t.model, t.version));
            assert_eq!(refused.map_err(|e| e.code), Err(Code::NotFound));
        }
        assert!(models.replace(VersionTable::configured(1, "ranker", 2)));
        assert!(models.replace(VersionTable::configured(2, "tower", 5)));
        assert_eq!(
            models.resolve(ranker).map(|t| (t.model, t.version)),
            Ok((1, 2))
        );
        let available = model_version_status::State::Available as i32;
        assert_eq!(
            states(&models, &spec("ranker", None)),
            Ok(vec![(2, available)])
        );
        assert_eq!(
            models.resolve(tower).map(|t| (t.model, t.version)),
            Ok((2, 5))
        );

        // The pool's first model stays first; names are each listed once.
        let refused = models.serve(&[ModelEntry::new("ranker", 2)]);
        assert_eq!(
            refused,
            Err("models must list the pool's first model wdl first".to_string())
        );
        let twice = [ModelEntry::new("wdl", 3), ModelEntry::new("wdl", 3)];
        assert!(models.serve(&twice).is_err());
        assert_eq!(models.iter().count(), 3, "a refused list changes nothing");
    }

    #[test]
    fn several_models_each_resolve_on_their_own_table() {
        let mut models =
            Models::configured(&[ModelEntry::new("wdl", 3), ModelEntry::new("ranker", 7)]).unwrap();
        assert_eq!(
            models.resolve(Some(&spec("ranker", None))),
            Ok(Target {
                model: 1,
                version: 7,
                pinned: false
            })
        );
        let three = Some(VersionChoice::Version(3));
        assert_eq!(
            models.resolve(Some(&spec("wdl", three.clone()))),
            Ok(Target {
                model: 0,
                version: 3,
                pinned: true
            })
        );
        // Versions are per model: ranker has no version 3.
        assert_eq!(
            models.resolve(Some(&spec("ranker", three))),
            Err(ServingError::new(
                Code::NotFound,
                "Servable not found for request: Specific(ranker, 3)"
            ))
        );
        assert_eq!(
            models.resolve(Some(&spec("nope", None))),
            Err(ServingError::new(
                Code::NotFound,
                "Servable not found for request: Latest(nope)"
            ))
        );
        assert_eq!(
            models.status(Some(&spec("nope", None)), |_| true),
            Err(ServingError::new(
                Code::NotFound,
                "Could not find any versions of model nope"
            ))
        );
        // The controller's table for ranker: its labels are its own.
        let listed = [
            rmpv::Value::Map(vec![
                ("version".into(), 7.into()),
                ("state".into(), "AVAILABLE".into()),
            ]),
            rmpv::Value::Map(vec![
                ("version".into(), 8.into()),
                ("state".into(), "AVAILABLE".into()),
            ]),
        ];
        let labels = rmpv::Value::Map(vec![("canary".into(), 8.into())]);
        let ranker = VersionTable::from_control(1, "ranker", &listed, Some(&labels)).unwrap();
        assert!(models.replace(ranker));
        let canary = Some(VersionChoice::VersionLabel("canary".into()));
        assert_eq!(
            models.resolve(Some(&spec("ranker", canary.clone()))),
            Ok(Target {
                model: 1,
                version: 8,
                pinned: true
            })
        );
        assert_eq!(
            models.resolve(Some(&spec("wdl", canary))),
            Err(ServingError::invalid_argument(
                "Unrecognized servable version label: canary"
            ))
        );
        assert_eq!(models.latest(), BTreeMap::from([(0, 3), (1, 8)]));
        let up = models
            .status(Some(&spec("ranker", None)), |s| s.model == 1)
            .unwrap();
        assert_eq!(up.len(), 2);
        // A table under another model's id is not taken.
        let stray = VersionTable::from_control(1, "wdl", &listed, None).unwrap();
        assert!(!models.replace(stray));
        assert!(Models::configured(&[]).is_none());
    }
}
