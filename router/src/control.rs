//! The controller's control channel: request/reply over a ROUTER socket in the private run
//! directory (`control.ipc`), msgpack maps `{"v": 1, "op": ..., "n": ...}`; every reply echoes
//! `n`, which lets the controller drop replies it gave up on. A bad message gets
//! `{"error": ...}`, never a crash.
//!
//! Ops: `snapshot` (what `mpspool status` and the controller's reconciling read), `gone`
//! (the controller saw a worker's process exit), `timeline` (`mpspool timeline`), `drain`
//! (start a graceful stop; the server performs it), `gpus` (the controller's NVML samples of
//! each GPU, exported as metrics), `versions` (the model's versions with their states and
//! errors, and its labels: where requests go from now on, and what GetModelStatus says; a
//! pool of several models names the one it means in `model`, the first by default),
//! `models` (the models to serve from now on, in order, each `{name, version}`: models
//! added while the pool serves, and removed: `Models::serve`), `reload_done` (the controller's answer to a HandleReloadConfigRequest the snapshot listed
//! in `reload_requests`: `id`, `code`, `message`).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rmpv::Value;

use crate::config::ModelEntry;
use crate::log_info;
use crate::state::{DrainRequest, GpuSample, RouterState, SlotSample, SLOT_STATES};
use crate::timeline::Timeline;
use crate::versions::{ModelId, Models, Servable, VersionTable};
use crate::wire;
use crate::workers::{Departure, WorkerTable};

/// What the ops read and change.
pub struct Pool<'a, P> {
    pub table: &'a mut WorkerTable<P>,
    pub timeline: &'a mut Timeline,
    pub versions: &'a tokio::sync::watch::Sender<Arc<Models>>,
    pub state: &'a RouterState,
    /// Requests waiting for a worker, by model.
    pub queued_by_model: &'a std::collections::BTreeMap<ModelId, u64>,
    pub now: Instant,
}

pub struct Reply<P> {
    pub message: Vec<u8>,
    /// Workers the op removed (`gone`): their requests are to be retried.
    pub departures: Vec<Departure<P>>,
}

pub fn answer<P>(body: &[u8], pool: &mut Pool<'_, P>) -> Reply<P> {
    let mut departures = Vec::new();
    let (n, mut fields) = match wire::decode_control(body) {
        Ok(request) => {
            let n = field(&request, "n").cloned().unwrap_or(Value::Nil);
            (n, op(&request, pool, &mut departures))
        }
        Err(error) => (Value::Nil, vec![("error", Value::from(error.to_string()))]),
    };
    fields.push(("n", n));
    Reply {
        message: wire::encode_control(fields),
        departures,
    }
}

fn field<'a>(request: &'a [(String, Value)], name: &str) -> Option<&'a Value> {
    request.iter().find(|(k, _)| k == name).map(|(_, v)| v)
}

/// A field of seconds in [0, MAX_SECONDS]: past it `Duration::from_secs_f64` panicked and
/// took the dispatcher with it (a drain of 1e30 s; found by a hunt).
fn seconds(request: &[(String, Value)], name: &str) -> Option<Duration> {
    let value = field(request, name)?;
    let secs = value
        .as_f64()
        .or_else(|| value.as_i64().map(|v| v as f64))?;
    crate::config::bounded_seconds(secs)
}

fn op<P>(
    request: &[(String, Value)],
    pool: &mut Pool<'_, P>,
    departures: &mut Vec<Departure<P>>,
) -> Vec<(&'static str, Value)> {
    let error = |message: String| vec![("error", Value::from(message))];
    let name = field(request, "op").and_then(Value::as_str).unwrap_or("");
    match name {
        "snapshot" => {
            let dead = pool
                .table
                .declared_dead
                .iter()
                .map(|(slot, pid)| (Value::from(slot.as_str()), Value::from(*pid)))
                .collect();
            vec![
                ("phase", Value::from(pool.state.phase.borrow().name())),
                (
                    "port",
                    Value::from(pool.state.grpc_port.load(Ordering::Relaxed)),
                ),
                (
                    "metrics_port",
                    Value::from(pool.state.metrics_port.load(Ordering::Relaxed)),
                ),
                (
                    "rest_port",
                    Value::from(pool.state.rest_port.load(Ordering::Relaxed)),
                ),
                ("workers", pool.table.snapshot(pool.now)),
                // With the front door's pid: its counts start again from 0 when it does.
                ("served", pool.table.served()),
                ("pid", Value::from(std::process::id())),
                ("declared_dead", Value::Map(dead)),
                ("inflight", Value::from(pool.table.inflight_total() as u64)),
                // Waiting in the front door for a worker with room (with --worker-inflight).
                (
                    "queued",
                    Value::from(pool.state.queued.load(Ordering::Relaxed)),
                ),
                // The same by model name: a version retiring waits for its own model's only.
                ("queued_by_model", queued_by_model(pool)),
                (
                    "reload_requests",
                    Value::Array(
                        pool.state
                            .reloads
                            .listed()
                            .into_iter()
                            .map(|(id, config)| {
                                Value::Array(vec![Value::from(id), Value::Binary(config)])
                            })
                            .collect(),
                    ),
                ),
            ]
        }
        "gone" => {
            let slot = field(request, "slot").and_then(Value::as_str);
            let pid = field(request, "pid").and_then(Value::as_i64);
            let (Some(slot), Some(pid)) = (slot, pid) else {
                return error("gone needs slot and pid".to_string());
            };
            let blameless = field(request, "blameless")
                .and_then(Value::as_bool)
                .unwrap_or(false);
            departures.extend(pool.table.gone(slot, pid, blameless));
            vec![("ok", Value::from(true))]
        }
        "timeline" => {
            let clear = field(request, "clear")
                .and_then(Value::as_bool)
                .unwrap_or(false);
            pool.timeline.take(clear)
        }
        "drain" => {
            let (Some(delay), Some(grace)) = (seconds(request, "delay"), seconds(request, "grace"))
            else {
                return error(format!(
                    "drain needs delay and grace in seconds, in [0, {:e}]",
                    crate::config::MAX_SECONDS
                ));
            };
            let _ = pool.state.drain.send(DrainRequest { delay, grace });
            vec![("ok", Value::from(true))]
        }
        "gpus" => {
            let Some(Value::Array(samples)) = field(request, "gpus") else {
                return error("gpus needs a list of samples".to_string());
            };
            let parsed: Option<Vec<GpuSample>> = samples.iter().map(gpu_sample).collect();
            let Some(parsed) = parsed else {
                return error(
                    "each gpus sample needs gpu, uuid, memory_used, memory_total, utilization"
                        .to_string(),
                );
            };
            pool.state.set_gpus(parsed);
            vec![("ok", Value::from(true))]
        }
        "slots" => {
            let Some(Value::Array(samples)) = field(request, "slots") else {
                return error("slots needs a list of samples".to_string());
            };
            let parsed: Option<Vec<SlotSample>> = samples.iter().map(slot_sample).collect();
            let Some(parsed) = parsed else {
                return error(format!(
                    "each slots sample needs slot, restarts, model, version and a state among {}",
                    SLOT_STATES.join(", ")
                ));
            };
            pool.table
                .forget_slots_not_in(parsed.iter().map(|sample| sample.slot.as_str()));
            pool.state.set_slots(parsed);
            vec![("ok", Value::from(true))]
        }
        "versions" => {
            let Some(Value::Array(rows)) = field(request, "versions") else {
                return error("versions needs a list of {version, state, error}".to_string());
            };
            let models = pool.versions.borrow().clone();
            let named = match field(request, "model") {
                None | Some(Value::Nil) => models.iter().next(),
                Some(name) => name.as_str().and_then(|name| models.named(name)),
            };
            let Some(current) = named else {
                let served: Vec<&str> = models.iter().map(|t| t.model.as_str()).collect();
                return error(format!(
                    "versions names a model this pool does not serve (it serves {})",
                    served.join(", ")
                ));
            };
            let labels = field(request, "labels");
            match VersionTable::from_control(current.id, &current.model, rows, labels) {
                Ok(mut table) => {
                    table.starting =
                        matches!(field(request, "starting"), Some(Value::Boolean(true)));
                    let listed = table.versions.keys().copied().collect();
                    pool.state.warmup.keep_versions_of(current.id, &listed);
                    pool.state.loads.keep_versions_of(current.id, &listed);
                    for (version, path, failures) in failed_loads(rows) {
                        let servable = Servable {
                            model: current.id,
                            version,
                        };
                        pool.state.loads.record_failures(servable, path, failures);
                    }
                    let mut models = Models::clone(&models);
                    models.replace(table);
                    pool.versions.send_replace(Arc::new(models));
                    vec![("ok", Value::from(true))]
                }
                Err(message) => error(message),
            }
        }
        "models" => {
            let Some(Value::Array(listed)) = field(request, "models") else {
                return error("models needs a list of {name, version}".to_string());
            };
            let Some(entries) = listed.iter().map(model_entry).collect::<Option<Vec<_>>>() else {
                return error("each model needs a name and a version".to_string());
            };
            // The removed models whose workers still drain (UNLOADING); absent: none.
            let draining: Vec<String> = match field(request, "removing") {
                Some(Value::Array(names)) => names
                    .iter()
                    .filter_map(|n| n.as_str().map(str::to_string))
                    .collect(),
                _ => Vec::new(),
            };
            let mut models = Models::clone(&pool.versions.borrow());
            match models.serve(&entries) {
                Ok(mut changed) => {
                    changed.extend(models.ended(&draining));
                    if !changed.is_empty() {
                        log_info!("models: {}", changed.join(", "));
                        // A removed model's series go: they stayed on the page for good.
                        let served = models.iter().map(|t| t.id).collect();
                        pool.state.warmup.keep_models(&served);
                        pool.state.loads.keep_models(&served);
                        pool.versions.send_replace(Arc::new(models));
                    }
                    vec![("ok", Value::from(true))]
                }
                Err(message) => error(message),
            }
        }
        "reload_done" => {
            let id = field(request, "id").and_then(Value::as_u64);
            let code = field(request, "code")
                .and_then(Value::as_i64)
                .and_then(|c| i32::try_from(c).ok());
            let (Some(id), Some(code)) = (id, code) else {
                return error("reload_done needs id and code".to_string());
            };
            let message = field(request, "message")
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_string();
            let delivered = pool.state.reloads.answer(id, (code, message));
            vec![("ok", Value::from(delivered))]
        }
        other => error(format!("unknown op '{other}'")),
    }
}

fn queued_by_model<P>(pool: &Pool<'_, P>) -> Value {
    let models = pool.versions.borrow();
    Value::Map(
        pool.queued_by_model
            .iter()
            .filter_map(|(id, n)| {
                Some((
                    Value::from(models.get(*id)?.model.as_str()),
                    Value::from(*n),
                ))
            })
            .collect(),
    )
}

/// A field of a msgpack map (None: not a map, or no such field).
fn map_field<'a>(value: &'a Value, name: &str) -> Option<&'a Value> {
    let Value::Map(entries) = value else {
        return None;
    };
    entries
        .iter()
        .find(|(k, _)| k.as_str() == Some(name))
        .map(|(_, v)| v)
}

/// The versions of a version table whose loads failed: (version, folder, failed attempts so
/// far). A row without the three, or with a count of 0, has none to say.
fn failed_loads(rows: &[Value]) -> impl Iterator<Item = (i64, &str, u64)> {
    rows.iter().filter_map(|row| {
        let version = map_field(row, "version")?.as_i64()?;
        let failures = map_field(row, "failed_loads")?.as_u64()?;
        let path = map_field(row, "path")?.as_str()?;
        (failures > 0).then_some((version, path, failures))
    })
}

fn model_entry(value: &Value) -> Option<ModelEntry> {
    let get = |name: &str| map_field(value, name);
    Some(ModelEntry::new(
        get("name")?.as_str()?,
        get("version")?.as_i64()?,
    ))
}

fn gpu_sample(value: &Value) -> Option<GpuSample> {
    let get = |name: &str| map_field(value, name);
    Some(GpuSample {
        gpu: get("gpu")?.as_u64()?,
        uuid: get("uuid")?.as_str()?.to_string(),
        memory_used: get("memory_used")?.as_u64()?,
        memory_total: get("memory_total")?.as_u64()?,
        utilization: get("utilization")?.as_u64()?,
    })
}

fn slot_sample(value: &Value) -> Option<SlotSample> {
    let get = |name: &str| map_field(value, name);
    let state = get("state")?.as_str()?;
    Some(SlotSample {
        slot: get("slot")?.as_str()?.to_string(),
        state: SLOT_STATES.iter().find(|known| **known == state)?,
        restarts: get("restarts")?.as_u64()?,
        model: get("model")?.as_str()?.to_string(),
        version: get("version")?.as_i64()?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ModelEntry;
    use crate::versions::Servable;

    const V1: Servable = Servable {
        model: 0,
        version: 1,
    };

    /// What the ops work on, owned; `pool` lends it out as the server does.
    struct Fixture {
        state: RouterState,
        table: WorkerTable<u32>,
        timeline: Timeline,
        versions: tokio::sync::watch::Sender<Arc<Models>>,
        queued_by_model: std::collections::BTreeMap<ModelId, u64>,
    }

    impl Fixture {
        fn new() -> (Fixture, tokio::sync::mpsc::UnboundedReceiver<DrainRequest>) {
            let (state, drains) = RouterState::new();
            let table = WorkerTable::<u32>::new(
                Duration::from_secs(3),
                crate::policies::chooser("round-robin").expect("known"),
            );
            let configured = [ModelEntry::new("demo", 1), ModelEntry::new("ranker", 4)];
            let models = Models::configured(&configured).expect("two models");
            let (versions, _) = tokio::sync::watch::channel(Arc::new(models));
            let timeline = Timeline::new(10);
            let fixture = Fixture {
                state,
                table,
                timeline,
                versions,
                // Two of ranker's requests wait; model 7 is none the pool knows.
                queued_by_model: std::collections::BTreeMap::from([(1, 2), (7, 1)]),
            };
            (fixture, drains)
        }

        fn pool(&mut self, now: Instant) -> Pool<'_, u32> {
            Pool {
                table: &mut self.table,
                timeline: &mut self.timeline,
                versions: &self.versions,
                state: &self.state,
                queued_by_model: &self.queued_by_model,
                now,
            }
        }
    }

    fn ask(pool: &mut Pool<'_, u32>, fields: serde_json::Value) -> serde_json::Value {
        let body = rmp_serde::to_vec_named(&fields).unwrap();
        let reply = answer(&body, pool);
        rmp_serde::from_slice(&reply.message).unwrap()
    }

    #[test]
    fn ops_answer_with_n_echoed() {
        let (mut fixture, mut drains) = Fixture::new();
        let now = Instant::now();
        fixture
            .table
            .register(b"cpu-0:10", "cpu-0", 10, V1, Value::Nil, now);
        let mut pool = fixture.pool(now);

        let gpus = ask(
            &mut pool,
            serde_json::json!({"v": 1, "op": "gpus", "n": 6, "gpus": [{"gpu": 2,
                "uuid": "GPU-a", "memory_used": 5, "memory_total": 80, "utilization": 40}]}),
        );
        assert_eq!(gpus["ok"], true);
        assert_eq!(pool.state.gpus()[0].memory_total, 80);
        let bad = ask(
            &mut pool,
            serde_json::json!({"v": 1, "op": "gpus", "n": 5, "gpus": [{"gpu": 2}]}),
        );
        assert!(bad["error"].as_str().unwrap().contains("memory_used"));
        assert_eq!(pool.state.gpus().len(), 1, "a bad sample changes nothing");

        let slots = ask(
            &mut pool,
            serde_json::json!({"v": 1, "op": "slots", "n": 8, "slots": [
                {"slot": "cpu-0@1", "state": "BACKOFF", "restarts": 2, "model": "demo",
                 "version": 1}]}),
        );
        assert_eq!(slots["ok"], true);
        assert_eq!(pool.state.slots()[0].state, "BACKOFF");
        assert_eq!(pool.state.slots()[0].restarts, 2);
        let unknown = ask(
            &mut pool,
            serde_json::json!({"v": 1, "op": "slots", "n": 9, "slots": [
                {"slot": "cpu-0@1", "state": "ASLEEP", "restarts": 2, "model": "demo",
                 "version": 1}]}),
        );
        assert!(unknown["error"]
            .as_str()
            .unwrap()
            .contains("BACKOFF, FATAL"));
        assert_eq!(
            pool.state.slots()[0].state,
            "BACKOFF",
            "a bad sample changes nothing"
        );

        let snap = ask(
            &mut pool,
            serde_json::json!({"v": 1, "op": "snapshot", "n": 7}),
        );
        assert_eq!(snap["n"], 7);
        assert_eq!(snap["phase"], "serving");
        assert_eq!(snap["workers"]["cpu-0"]["pid"], 10);
        assert_eq!(snap["workers"]["cpu-0"]["version"], 1);
        assert_eq!(snap["queued_by_model"], serde_json::json!({"ranker": 2}));

        let listed = ask(
            &mut pool,
            serde_json::json!({"v": 1, "op": "versions", "n": 11, "versions": [
                {"version": 1, "state": "UNLOADING"},
                {"version": 2, "state": "AVAILABLE"},
                {"version": 3, "state": "END", "error": "cannot load"}],
                "labels": {"canary": 2}}),
        );
        assert_eq!(listed["ok"], true);
        let models = pool.versions.borrow().clone();
        let table = models.get(0).unwrap();
        assert_eq!((table.model.as_str(), table.latest()), ("demo", Some(2)));
        assert_eq!(table.labels.get("canary"), Some(&2));
        assert_eq!(
            models.get(1).unwrap().latest(),
            Some(4),
            "no model named: the first"
        );
        let ranker = ask(
            &mut pool,
            serde_json::json!({"v": 1, "op": "versions", "n": 13, "model": "ranker",
                "versions": [{"version": 5, "state": "AVAILABLE"}]}),
        );
        assert_eq!(ranker["ok"], true);
        let models = pool.versions.borrow().clone();
        assert_eq!(models.get(1).unwrap().latest(), Some(5));
        assert_eq!(models.get(0).unwrap().latest(), Some(2));
        let unknown = ask(
            &mut pool,
            serde_json::json!({"v": 1, "op": "versions", "n": 14, "model": "nope",
                "versions": [{"version": 5, "state": "AVAILABLE"}]}),
        );
        assert_eq!(
            unknown["error"],
            "versions names a model this pool does not serve (it serves demo, ranker)"
        );
        // Models added and removed: a version table for the new one is then taken.
        let added = ask(
            &mut pool,
            serde_json::json!({"v": 1, "op": "models", "n": 15, "models": [
                {"name": "demo", "version": 2}, {"name": "tower", "version": 1}]}),
        );
        assert_eq!(added["ok"], true);
        let tower = ask(
            &mut pool,
            serde_json::json!({"v": 1, "op": "versions", "n": 16, "model": "tower",
                "versions": [{"version": 4, "state": "AVAILABLE"}]}),
        );
        assert_eq!(tower["ok"], true);
        let models = pool.versions.borrow().clone();
        let served: Vec<&str> = models.iter().map(|t| t.model.as_str()).collect();
        assert_eq!(served, ["demo", "tower"], "ranker, not listed, is removed");
        assert_eq!(models.named("tower").and_then(|t| t.latest()), Some(4));
        let refused = ask(
            &mut pool,
            serde_json::json!({"v": 1, "op": "models", "n": 17, "models": [
                {"name": "tower", "version": 1}]}),
        );
        assert!(refused["error"]
            .as_str()
            .unwrap()
            .contains("first model demo first"));
        let bad = ask(
            &mut pool,
            serde_json::json!({"v": 1, "op": "models", "n": 18, "models": [{"name": "x"}]}),
        );
        assert_eq!(bad["error"], "each model needs a name and a version");

        let bad = ask(
            &mut pool,
            serde_json::json!({"v": 1, "op": "versions", "n": 12, "versions": [{"version": 1}]}),
        );
        assert!(bad["error"]
            .as_str()
            .unwrap()
            .contains("needs version and state"));
        assert_eq!(
            pool.versions.borrow().get(0).unwrap().latest(),
            Some(2),
            "a bad table changes nothing"
        );
        assert_eq!(snap["inflight"], 0);

        let gone = ask(
            &mut pool,
            serde_json::json!({"v": 1, "op": "gone", "slot": "cpu-0", "pid": 10, "n": 8}),
        );
        assert_eq!(gone["ok"], true);
        assert_eq!(pool.table.ready(), 0);

        let drain = ask(
            &mut pool,
            serde_json::json!({"v": 1, "op": "drain", "delay": 0.5, "grace": 2, "n": 9}),
        );
        assert_eq!(drain["ok"], true);
        assert_eq!(drains.try_recv().unwrap().grace, Duration::from_secs(2));
        // No Duration holds 1e30 s: an error reply, not a panic of the dispatcher.
        for delay in [1e30, 2.2e9, -1.0] {
            let huge = ask(
                &mut pool,
                serde_json::json!({"v": 1, "op": "drain", "delay": delay, "grace": 2, "n": 9}),
            );
            assert!(huge["error"]
                .as_str()
                .unwrap()
                .starts_with("drain needs delay and grace in seconds"));
        }
        assert!(drains.try_recv().is_err());

        let bad = ask(
            &mut pool,
            serde_json::json!({"v": 1, "op": "dance", "n": 10}),
        );
        assert_eq!(bad["error"], "unknown op 'dance'");
        let reply = answer(b"\xc1garbage", &mut pool);
        let bad: serde_json::Value = rmp_serde::from_slice(&reply.message).unwrap();
        assert!(bad["error"].as_str().unwrap().contains("undecodable"));
    }

    #[test]
    fn reload_requests_are_listed_until_the_controller_answers() {
        let (mut fixture, _drains) = Fixture::new();
        let mut pool = fixture.pool(Instant::now());
        let mut call = pool.state.reloads.submit(b"\x0a\x00".to_vec());
        let listed = |pool: &mut Pool<'_, u32>| {
            let body =
                rmp_serde::to_vec_named(&serde_json::json!({"v": 1, "op": "snapshot", "n": 1}))
                    .expect("encodes");
            let reply = answer(&body, pool);
            let snap = rmpv::decode::read_value(&mut reply.message.as_slice()).expect("decodes");
            let found = snap
                .as_map()
                .and_then(|m| {
                    m.iter()
                        .find(|(k, _)| k.as_str() == Some("reload_requests"))
                })
                .map(|(_, v)| v.clone());
            found.expect("listed in every snapshot")
        };
        let id = pool.state.reloads.listed()[0].0;
        let expected = Value::Array(vec![Value::Array(vec![
            Value::from(id),
            Value::Binary(b"\x0a\x00".to_vec()),
        ])]);
        assert_eq!(listed(&mut pool), expected);
        assert_eq!(listed(&mut pool), expected, "until answered");
        let done = ask(
            &mut pool,
            serde_json::json!({"v": 1, "op": "reload_done", "n": 2, "id": id, "code": 9,
                "message": "not available"}),
        );
        assert_eq!(done["ok"], true);
        assert_eq!(call.try_recv().ok(), Some((9, "not available".to_string())));
        assert_eq!(listed(&mut pool), Value::Array(vec![]));
        let again = ask(
            &mut pool,
            serde_json::json!({"v": 1, "op": "reload_done", "n": 3, "id": id, "code": 0}),
        );
        assert_eq!(again["ok"], false, "answered already");
        let bad = ask(
            &mut pool,
            serde_json::json!({"v": 1, "op": "reload_done", "n": 4}),
        );
        assert_eq!(bad["error"], "reload_done needs id and code");
    }
}
