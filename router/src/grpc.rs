//! TF Serving's gRPC API: PredictionService (Predict, GetModelMetadata) and ModelService
//! (GetModelStatus), under TF Serving's own service names, so any TF Serving client works
//! unchanged. Status codes and messages follow TF Serving's; errors become `tonic::Status`
//! only through `From<ServingError>`.
//!
//! A Predict is checked completely here before it costs a hop: model spec, signature, each
//! input's dtype and shape against the signature (before any value is expanded), the output
//! filter; then its tensors become worker frames and the dispatcher runs it.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tonic::{Request, Response, Status};

use crate::codec;
use crate::decode_budget;
use crate::dispatch::Dispatcher;
use crate::dispatch::{WorkReply, WorkRequest};
use crate::inference::{self, Task};
use crate::metrics::{Entrypoint, Method, Metrics, TfApi};
use crate::proto::mpspool::tfs::{
    model_spec::VersionChoice, GetModelMetadataRequest, GetModelMetadataResponse,
    GetModelStatusRequest, GetModelStatusResponse, ModelSpec, PredictRequest, PredictResponse,
    StatusProto,
};
use crate::proto::tensorflow::serving::model_service_server::ModelService;
use crate::proto::tensorflow::serving::prediction_service_server::PredictionService;
use crate::proto::tensorflow::serving::{
    inference_result, Class, ClassificationRequest, ClassificationResponse, ClassificationResult,
    Classifications, InferenceResult, Input, MultiInferenceRequest, MultiInferenceResponse,
    Regression, RegressionRequest, RegressionResponse, RegressionResult, ReloadConfigRequest,
    ReloadConfigResponse,
};
use crate::request_budget::{Held, KeptShare};
use crate::server::Peer;
use crate::signature::{self, ModelSignatures, SignatureSpec};
use crate::state::RouterState;
use crate::status::{Code, ServingError};
use crate::versions::{ModelId, Servable, Target};

/// A request whose worker frames take at least this many bytes to build has them built on one
/// of tokio's blocking threads, as REST's large bodies and answers are (`rest.rs`).
const BLOCKING_BUILD_BYTES: u64 = 1 << 20;

pub const SIGNATURE_DEF_MAP_URL: &str = "type.googleapis.com/tensorflow.serving.SignatureDefMap";

#[derive(Clone)]
pub struct Api {
    pub dispatcher: Dispatcher,
    pub metrics: Arc<Metrics>,
    /// Outputs in `tensor_content` (TF Serving's `--enable_serialization_as_tensor_content`)
    /// instead of the typed fields TF Serving fills by default.
    pub tensor_content_outputs: bool,
    /// Classify/Regress/MultiInference require the signature's method name to match (TF
    /// Serving's `--enable_signature_method_name_check`; off by default there too).
    pub method_name_check: bool,
    /// Where HandleReloadConfigRequest calls wait for the controller.
    pub state: Arc<RouterState>,
}

impl Api {
    /// The version a request's spec names (TF Serving's rules: `VersionTable::resolve`).
    pub fn resolve(&self, spec: Option<&ModelSpec>) -> Result<Target, ServingError> {
        self.dispatcher.versions().resolve(spec)
    }

    /// `resolve` for a request whose own `model_spec` names the model (Predict, Classify,
    /// Regress, GetModelMetadata): TF Serving refuses one without it before anything else.
    fn resolve_own(&self, spec: Option<&ModelSpec>) -> Result<Target, ServingError> {
        self.resolve(Some(crate::versions::spec_given(spec)?))
    }

    /// The name of a served model.
    fn model_name(&self, model: ModelId) -> String {
        let versions = self.dispatcher.versions();
        versions
            .get(model)
            .map_or_else(String::new, |t| t.model.clone())
    }

    /// The signatures of a target's model version, as its workers reported them.
    pub fn signatures(&self, target: Target) -> Result<Arc<ModelSignatures>, ServingError> {
        let found = self
            .dispatcher
            .signatures()
            .borrow()
            .get(&target.servable())
            .cloned();
        found.ok_or_else(|| {
            ServingError::new(
                Code::Unavailable,
                format!(
                    "model {} version {} is still loading",
                    self.model_name(target.model),
                    target.version
                ),
            )
        })
    }

    fn served_spec(&self, model: ModelId, version: i64, signature_name: &str) -> ModelSpec {
        ModelSpec {
            name: self.model_name(model),
            version_choice: Some(VersionChoice::Version(version)),
            signature_name: signature_name.to_string(),
        }
    }

    /// A checked request on a worker; its span goes to the metrics as `api`'s (None: not in
    /// TF Serving's runtime_latency). The work takes the request's shares of the budget with
    /// it (its decoded form's and `built`, what building its frames added), held until the
    /// last copy of its frames goes, which may be after this call is dropped (`KeptShare`).
    async fn run(
        &self,
        mut work: WorkRequest,
        deadline: Option<Instant>,
        api: Option<TfApi>,
        built: Option<Held>,
    ) -> Result<WorkReply, ServingError> {
        let model = work.target.model;
        work.memory = KeptShare::new(decode_budget::take_request_share(), built);
        let kept = work.memory.clone();
        let reply = self.dispatcher.call(work, deadline).await?;
        // Answered: every chunk is done, and the answer takes the request's share over.
        decode_budget::give_back_request_share(kept.take_request());
        if let Some((start, end)) = reply.span {
            let compute = u64::try_from(end - start).unwrap_or(0);
            self.metrics.record_compute(model, api, compute);
        }
        Ok(reply)
    }

    /// The served model a request names, if any (such requests are counted in TF Serving's
    /// metrics, under that model).
    pub fn served_model(&self, name: &str) -> Option<ModelId> {
        self.dispatcher.versions().named(name).map(|t| t.id)
    }

    fn model_of(&self, spec: Option<&ModelSpec>) -> Option<ModelId> {
        spec.and_then(|s| self.served_model(&s.name))
    }

    /// A Predict, checked and run; its outputs in the typed fields unless `tensor_content`.
    pub async fn predict_checked(
        &self,
        request: PredictRequest,
        deadline: Option<Instant>,
        tensor_content: bool,
    ) -> Result<PredictResponse, ServingError> {
        let target = self.resolve_own(request.model_spec.as_ref())?;
        let signatures = self.signatures(target)?;
        let name = request
            .model_spec
            .as_ref()
            .map_or("", |s| s.signature_name.as_str());
        let spec = signatures.select(name)?;
        if self.method_name_check {
            inference::check_predict_method(spec)?;
        }
        // In the aliases' order, not the map's (whose order differs from one request to the
        // next): requests that can share a call must list their inputs alike, as TF Serving's
        // batching keys on the set of names; and a request's rows are its first input's.
        let mut inputs: Vec<_> = request.inputs.iter().collect();
        inputs.sort_unstable_by(|a, b| a.0.cmp(b.0));
        let mut declared = Vec::with_capacity(inputs.len());
        for (alias, proto) in inputs {
            let (dtype, shape) = codec::declared(proto, alias)?;
            declared.push((alias.as_str(), dtype, shape));
        }
        let given: Vec<(&str, i32, &[i64])> = declared
            .iter()
            .map(|(a, d, s)| (*a, *d, s.as_slice()))
            .collect();
        signature::check_inputs(spec, &given)?;
        let outputs = signature::check_output_filter(spec, &request.output_filter)?;
        // What the worker frames take beyond the request's own tensors (which its share of
        // the budget counts already, and which each frame replaces as it is built: a value
        // repeated to fill a shape) is held first, until the call ends; large ones are built
        // off the runtime's threads: filling [10000000, 13] from one value held every other
        // request on this thread for 0.4 s (found by a hunt).
        // Not while a frame is a slice of the received message (numbers in `tensor_content`,
        // sent as they came): that keeps the whole message, its strings too, for as long as
        // the call (strings were then in memory twice, counted once; found by a review).
        let keeps_message = declared.iter().any(|(a, d, _)| {
            *d != codec::DT_STRING && !request.inputs[*a].tensor_content.is_empty()
        });
        let (built, beyond) = declared
            .iter()
            .fold((0u64, 0u64), |(all, more), (a, d, s)| {
                let proto = &request.inputs[*a];
                let bytes = codec::built_bytes(proto, *d, s);
                let counted = if keeps_message {
                    0
                } else {
                    decode_budget::tensor_memory(proto) as u64
                };
                (
                    all.saturating_add(bytes),
                    more.saturating_add(bytes.saturating_sub(counted)),
                )
            });
        let built_held = decode_budget::budget().hold_built(
            beyond,
            decode_budget::request_share_bytes(),
            decode_budget::UNCOUNTED_BYTES,
        )?;
        let declared: Vec<(String, i32, Vec<i64>)> = declared
            .into_iter()
            .map(|(alias, dtype, shape)| (alias.to_string(), dtype, shape))
            .collect();
        let mut inputs = request.inputs;
        let (tensors, frames, built_held) = crate::rest::on_a_blocking_thread_if(
            built >= BLOCKING_BUILD_BYTES,
            "building the request's tensors",
            move || {
                let mut tensors = Vec::with_capacity(declared.len());
                let mut frames = Vec::with_capacity(declared.len());
                for (alias, dtype, shape) in declared {
                    let proto = inputs.remove(&alias).unwrap_or_default();
                    frames.push(codec::materialize(&proto, &alias, dtype, &shape)?);
                    tensors.push((alias, dtype, shape));
                }
                // Held by the build itself: a caller that goes away (cancelled, its deadline
                // passed) drops this call, not a build on a blocking thread, which took what
                // it held with it (7 GiB against a 256 MiB budget; found by a review).
                Ok((tensors, frames, built_held))
            },
        )
        .await?;
        let work = WorkRequest {
            target,
            signature: spec.key.clone(),
            tensors,
            frames,
            row_wise: spec.answers_row_by_row(&outputs),
            outputs,
            memory: KeptShare::default(),
        };
        let reply = self
            .run(work, deadline, Some(TfApi::Predict), built_held)
            .await?;
        let mut response = PredictResponse {
            model_spec: Some(self.served_spec(target.model, reply.version, &spec.key)),
            ..PredictResponse::default()
        };
        let output_tensor = if tensor_content {
            codec::output_tensor
        } else {
            codec::output_tensor_typed
        };
        for ((name, dtype, shape), frame) in reply.tensors.into_iter().zip(reply.frames) {
            response
                .outputs
                .insert(name, output_tensor(dtype, &shape, frame)?);
        }
        Ok(response)
    }

    /// A Classify or Regress on `input` with the signature `spec` names: the worker's answer
    /// and the number of examples it is for.
    async fn infer(
        &self,
        spec: Option<&ModelSpec>,
        input: Option<&Input>,
        task: Task,
        deadline: Option<Instant>,
    ) -> Result<(WorkReply, usize, ModelSpec), ServingError> {
        // TF Serving's order (classifier.cc, regressor.cc): the servable, its signature and
        // that signature's checks, then the examples, then the feed.
        let target = self.resolve_own(spec)?;
        let signatures = self.signatures(target)?;
        let name = spec.map_or("", |s| s.signature_name.as_str());
        let (signature, outputs) =
            inference::signature_for(&signatures, name, task, self.method_name_check)?;
        let examples = inference::serialized_examples(input)?;
        inference::check_feed(signature)?;
        let api = match task {
            Task::Classify => TfApi::Classify,
            Task::Regress => TfApi::Regress,
        };
        let reply = self
            .run_task(target, signature, outputs, &examples, Some(api), deadline)
            .await?;
        let served = self.served_spec(target.model, reply.version, &signature.key);
        Ok((reply, examples.len(), served))
    }

    /// One checked Classify or Regress task on the worker.
    async fn run_task(
        &self,
        target: Target,
        signature: &SignatureSpec,
        outputs: Vec<String>,
        examples: &[bytes::Bytes],
        api: Option<TfApi>,
        deadline: Option<Instant>,
    ) -> Result<WorkReply, ServingError> {
        let work = inference::work(target, signature, outputs, examples);
        self.run(work, deadline, api, None).await
    }

    pub async fn classify_checked(
        &self,
        request: ClassificationRequest,
        deadline: Option<Instant>,
    ) -> Result<ClassificationResponse, ServingError> {
        let (reply, n, spec) = self
            .infer(
                request.model_spec.as_ref(),
                request.input.as_ref(),
                Task::Classify,
                deadline,
            )
            .await?;
        Ok(ClassificationResponse {
            model_spec: Some(spec),
            result: Some(inference::classification_result(&reply, n)?),
        })
    }

    pub async fn regress_checked(
        &self,
        request: RegressionRequest,
        deadline: Option<Instant>,
    ) -> Result<RegressionResponse, ServingError> {
        let (reply, n, spec) = self
            .infer(
                request.model_spec.as_ref(),
                request.input.as_ref(),
                Task::Regress,
                deadline,
            )
            .await?;
        Ok(RegressionResponse {
            model_spec: Some(spec),
            result: Some(inference::regression_result(&reply, n)?),
        })
    }

    /// TF Serving's `RunMultiInferenceWithServerCore` then `TensorFlowMultiInferenceRunner::
    /// Infer`, in their order: the servable of the first task's spec (an empty list: the
    /// default spec, which names no model), then each task in turn (its name, the same model,
    /// no signature twice, its signature, its method and that signature's checks), all
    /// before any runs. Every task runs on that servable: a later task's version or label is
    /// never looked at. Tasks run one after another on the same examples (TF Serving runs
    /// them in one session call: the answers are the same).
    async fn multi_inference_checked(
        &self,
        request: MultiInferenceRequest,
        deadline: Option<Instant>,
    ) -> Result<MultiInferenceResponse, ServingError> {
        let first = request.tasks.first().and_then(|t| t.model_spec.as_ref());
        let target = Target {
            pinned: true,
            ..self.resolve(first)?
        };
        let signatures = self.signatures(target)?;
        let mut model = "";
        let mut seen = std::collections::BTreeSet::new();
        let mut plans = Vec::with_capacity(request.tasks.len());
        for task in &request.tasks {
            let spec = task.model_spec.as_ref();
            let name = spec.map_or("", |s| s.name.as_str());
            if name.is_empty() {
                return Err(ServingError::invalid_argument(
                    "Found ModelSpec with an empty model name.",
                ));
            }
            if model.is_empty() {
                model = name;
            } else if model != name {
                return Err(ServingError::invalid_argument(
                    "All ModelSpecs in a MultiInferenceRequest must access the same model name.",
                ));
            }
            let signature = spec
                .map(|s| s.signature_name.as_str())
                .filter(|s| !s.is_empty())
                .unwrap_or(signature::DEFAULT_SIGNATURE);
            if !seen.insert(signature) {
                return Err(ServingError::invalid_argument(format!(
                    "Duplicate evaluation of signature: {signature}"
                )));
            }
            if !signatures.specs.contains_key(signature) {
                return Err(ServingError::invalid_argument(format!(
                    "Requested signature not found in model graph: {signature}"
                )));
            }
            let kind = match task.method_name.as_str() {
                inference::CLASSIFY_METHOD => Task::Classify,
                inference::REGRESS_METHOD => Task::Regress,
                other => {
                    return Err(ServingError::new(
                        Code::Unimplemented,
                        format!("Unsupported signature method_name: {other}"),
                    ))
                }
            };
            let (signature, outputs) =
                inference::signature_for(&signatures, signature, kind, self.method_name_check)?;
            plans.push((signature, outputs, kind));
        }
        // The examples once, for every task.
        let examples = inference::serialized_examples(request.input.as_ref())?;
        // As TF Serving: the one session run that feeds every task's input comes after
        // every task's checks and the examples.
        for (signature, _, _) in &plans {
            inference::check_feed(signature)?;
        }
        let n = examples.len();
        let mut response = MultiInferenceResponse::default();
        for (signature, outputs, kind) in plans {
            let reply = self
                // Not in runtime_latency: TF Serving's multi_inference.cc does not time it.
                .run_task(target, signature, outputs, &examples, None, deadline)
                .await?;
            let result = match kind {
                Task::Classify => inference_result::Result::ClassificationResult(
                    inference::classification_result(&reply, n)?,
                ),
                Task::Regress => inference_result::Result::RegressionResult(
                    inference::regression_result(&reply, n)?,
                ),
            };
            if response.results.is_empty() {
                // As TF Serving: once it ran.
                self.metrics.tf_serving.record_examples(target.model, n);
            }
            response.results.push(InferenceResult {
                model_spec: Some(self.served_spec(target.model, reply.version, &signature.key)),
                result: Some(result),
            });
        }
        Ok(response)
    }

    pub fn metadata_checked(
        &self,
        request: &GetModelMetadataRequest,
    ) -> Result<GetModelMetadataResponse, ServingError> {
        // TF Serving's order (get_model_metadata_impl.cc): the spec, then that some field is
        // asked for, then each field in turn, the model looked up at "signature_def", the
        // only one it knows. So a wrong first field is named even for a model not served,
        // and a wrong later one only once the model is found.
        let spec = crate::versions::spec_given(request.model_spec.as_ref())?;
        let unsupported = |field: &str| {
            ServingError::invalid_argument(format!("Metadata field {field} is not supported"))
        };
        match request.metadata_field.first() {
            None => {
                return Err(ServingError::invalid_argument(
                    "GetModelMetadataRequest must specify at least one metadata_field",
                ))
            }
            Some(first) if first != "signature_def" => return Err(unsupported(first)),
            Some(_) => {}
        }
        let target = self.resolve(Some(spec))?;
        let signatures = self.signatures(target)?;
        if let Some(other) = request
            .metadata_field
            .iter()
            .find(|f| *f != "signature_def")
        {
            return Err(unsupported(other));
        }
        let mut response = GetModelMetadataResponse {
            model_spec: Some(self.served_spec(target.model, target.version, "")),
            ..GetModelMetadataResponse::default()
        };
        response.metadata.insert(
            "signature_def".to_string(),
            prost_types::Any {
                type_url: SIGNATURE_DEF_MAP_URL.to_string(),
                value: signatures.signature_defs.to_vec(),
            },
        );
        Ok(response)
    }

    pub fn status_checked(
        &self,
        request: &GetModelStatusRequest,
    ) -> Result<GetModelStatusResponse, ServingError> {
        let signatures = self.dispatcher.signatures().borrow().clone();
        let ready = *self.dispatcher.ready_workers().borrow() > 0;
        let up = |servable: Servable| ready && signatures.contains_key(&servable);
        let model_version_status = self
            .dispatcher
            .versions()
            .status(request.model_spec.as_ref(), up)?;
        Ok(GetModelStatusResponse {
            model_version_status,
        })
    }
}

/// A call's deadline, from its `grpc-timeout` counted from when its headers came: set then
/// (server.rs), before its body is read, as gRPC defines it.
#[derive(Clone, Copy, Debug)]
pub struct CallDeadline(pub Instant);

/// The deadline of a call: the one set as its headers came; one without (a call with no
/// `grpc-timeout`, or one not come through server.rs) is read from its metadata now.
fn call_deadline<T>(request: &Request<T>) -> Option<Instant> {
    match request.extensions().get::<CallDeadline>() {
        Some(deadline) => Some(deadline.0),
        None => deadline_of(request.metadata(), Instant::now()),
    }
}

/// The client's deadline from the `grpc-timeout` header ("<digits><unit>", unit one of
/// H M S m u n), as gRPC's HTTP/2 protocol defines it; None when absent or malformed.
pub fn deadline_of(metadata: &tonic::metadata::MetadataMap, now: Instant) -> Option<Instant> {
    deadline_in(metadata.as_ref(), now)
}

/// `deadline_of` from a call's HTTP headers.
pub fn deadline_in(headers: &http::HeaderMap, now: Instant) -> Option<Instant> {
    let value = headers.get("grpc-timeout")?.to_str().ok()?;
    let (digits, unit) = value.split_at(value.len().checked_sub(1)?);
    // At most 8 ASCII digits (u64's parse also took a sign: "+5S").
    if digits.is_empty() || digits.len() > 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    let timeout = match unit {
        "H" => Duration::from_secs(n * 3600),
        "M" => Duration::from_secs(n * 60),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    };
    now.checked_add(timeout)
}

/// `response`, its share of the budget held until its client takes it (answer_body): its
/// encoded size, or what its decoded form takes (`decoded`) if more; RESOURCE_EXHAUSTED when
/// there is no room. Every answer a client may leave untaken goes through here: only
/// Predict's did, and twenty 33-byte Classify streams whose client opened no window held
/// 1.1 GB, the budget counting none and the connection never closed (found by a hunt).
fn held_until_taken<M: prost::Message>(response: M, decoded: usize) -> Result<M, ServingError> {
    crate::answer_body::hold_answer(response.encoded_len().max(decoded))?;
    Ok(response)
}

/// What a Classify answer's decoded form takes: a `Class` per score, its label's bytes.
fn classification_memory(result: &ClassificationResult) -> usize {
    let classes = (result.classifications.iter()).map(|c| {
        c.classes.len() * std::mem::size_of::<Class>()
            + c.classes
                .iter()
                .map(|class| class.label.len())
                .sum::<usize>()
    });
    classes.sum::<usize>() + result.classifications.len() * std::mem::size_of::<Classifications>()
}

/// What a Regress answer's decoded form takes.
fn regression_memory(result: &RegressionResult) -> usize {
    result.regressions.len() * std::mem::size_of::<Regression>()
}

fn finish<T>(
    result: Result<T, ServingError>,
    guard: &mut crate::metrics::InFlight<'_>,
) -> Result<Response<T>, Status> {
    match result {
        Ok(value) => {
            guard.set_code(Code::Ok);
            Ok(Response::new(value))
        }
        Err(error) => {
            guard.set_code(error.code);
            Err(error.into())
        }
    }
}

#[tonic::async_trait]
impl PredictionService for Api {
    async fn predict(
        &self,
        request: Request<PredictRequest>,
    ) -> Result<Response<PredictResponse>, Status> {
        let mut guard = self.metrics.start(Method::Predict);
        if let Some(model) = self.model_of(request.get_ref().model_spec.as_ref()) {
            guard.tf_serving(model, TfApi::Predict, Entrypoint::Grpc);
        }
        let deadline = call_deadline(&request);
        guard.expires(deadline);
        let result = self
            .predict_checked(request.into_inner(), deadline, self.tensor_content_outputs)
            .await
            .and_then(|response| {
                // Until it is encoded its decoded tensors are what it takes, if more.
                let decoded: usize = response
                    .outputs
                    .values()
                    .map(crate::decode_budget::tensor_memory)
                    .sum();
                held_until_taken(response, decoded)
            });
        finish(result, &mut guard)
    }

    async fn classify(
        &self,
        request: Request<ClassificationRequest>,
    ) -> Result<Response<ClassificationResponse>, Status> {
        let mut guard = self.metrics.start(Method::Classify);
        if let Some(model) = self.model_of(request.get_ref().model_spec.as_ref()) {
            guard.tf_serving(model, TfApi::Classify, Entrypoint::Grpc);
        }
        let deadline = call_deadline(&request);
        guard.expires(deadline);
        let result = self.classify_checked(request.into_inner(), deadline).await;
        let result = result.and_then(|r| {
            let decoded = r.result.as_ref().map_or(0, classification_memory);
            held_until_taken(r, decoded)
        });
        finish(result, &mut guard)
    }

    async fn regress(
        &self,
        request: Request<RegressionRequest>,
    ) -> Result<Response<RegressionResponse>, Status> {
        let mut guard = self.metrics.start(Method::Regress);
        if let Some(model) = self.model_of(request.get_ref().model_spec.as_ref()) {
            guard.tf_serving(model, TfApi::Regress, Entrypoint::Grpc);
        }
        let deadline = call_deadline(&request);
        guard.expires(deadline);
        let result = self.regress_checked(request.into_inner(), deadline).await;
        let result = result.and_then(|r| {
            let decoded = r.result.as_ref().map_or(0, regression_memory);
            held_until_taken(r, decoded)
        });
        finish(result, &mut guard)
    }

    async fn multi_inference(
        &self,
        request: Request<MultiInferenceRequest>,
    ) -> Result<Response<MultiInferenceResponse>, Status> {
        // Not in TF Serving's request_count or request_latency: its MultiInference does not
        // record them (prediction_service_impl.cc); its examples are counted once run.
        let mut guard = self.metrics.start(Method::MultiInference);
        let deadline = call_deadline(&request);
        guard.expires(deadline);
        let result = self
            .multi_inference_checked(request.into_inner(), deadline)
            .await;
        let result = result.and_then(|r| {
            let decoded = (r.results.iter())
                .map(|one| match &one.result {
                    Some(inference_result::Result::ClassificationResult(c)) => {
                        classification_memory(c)
                    }
                    Some(inference_result::Result::RegressionResult(r)) => regression_memory(r),
                    None => 0,
                })
                .sum();
            held_until_taken(r, decoded)
        });
        finish(result, &mut guard)
    }

    async fn get_model_metadata(
        &self,
        request: Request<GetModelMetadataRequest>,
    ) -> Result<Response<GetModelMetadataResponse>, Status> {
        let mut guard = self.metrics.start(Method::GetModelMetadata);
        let result = self
            .metadata_checked(request.get_ref())
            .and_then(|r| held_until_taken(r, 0));
        finish(result, &mut guard)
    }
}

#[tonic::async_trait]
impl ModelService for Api {
    async fn get_model_status(
        &self,
        request: Request<GetModelStatusRequest>,
    ) -> Result<Response<GetModelStatusResponse>, Status> {
        let mut guard = self.metrics.start(Method::GetModelStatus);
        let result = self.status_checked(request.get_ref());
        finish(result, &mut guard)
    }

    /// Handed to the controller, which applies the config's version policy and labels and
    /// answers once they are in effect (supervisor/config_reload.py); the call waits for that
    /// (or the client's deadline). An admin action: taken only from this host, and there
    /// only from the pool's user (or root).
    async fn handle_reload_config_request(
        &self,
        request: Request<ReloadConfigRequest>,
    ) -> Result<Response<ReloadConfigResponse>, Status> {
        if !Peer::is_local(request.extensions()) {
            return Err(ServingError::new(
                Code::PermissionDenied,
                "HandleReloadConfigRequest changes the pool's configuration, an admin action: \
                 it is taken only over loopback (127.0.0.1, ::1) or the UNIX socket",
            )
            .into());
        }
        if !Peer::is_this_user(request.extensions()) {
            return Err(ServingError::new(
                Code::PermissionDenied,
                "HandleReloadConfigRequest changes the pool's configuration, an admin action: \
                 it is taken only from the user the pool runs as (or root)",
            )
            .into());
        }
        let answer = self
            .state
            .reloads
            .submit(request.into_inner().config.to_vec());
        match answer.await {
            Ok((0, _)) => Ok(Response::new(ReloadConfigResponse {
                status: Some(StatusProto {
                    error_code: 0,
                    error_message: String::new(),
                }),
            })),
            Ok((code, message)) => Err(ServingError::new(Code::from_i32(code), message).into()),
            Err(_) => Err(ServingError::new(
                Code::Unavailable,
                "the front door restarted before the controller answered",
            )
            .into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ModelEntry;
    use crate::versions::Models;

    /// A pool serving version 3 of demo (and version 1 of another model), as configured.
    fn models() -> Models {
        Models::configured(&[ModelEntry::new("demo", 3), ModelEntry::new("other", 1)]).unwrap()
    }

    fn spec(name: &str, choice: Option<VersionChoice>) -> ModelSpec {
        ModelSpec {
            name: name.to_string(),
            version_choice: choice,
            signature_name: String::new(),
        }
    }

    fn refusal(spec: Option<&ModelSpec>) -> Option<(Code, String)> {
        models().resolve(spec).err().map(|e| (e.code, e.message))
    }

    #[test]
    fn model_specs_are_checked_as_tf_serving_does() {
        use VersionChoice::{Version, VersionLabel};
        assert_eq!(refusal(Some(&spec("demo", None))), None);
        assert_eq!(refusal(Some(&spec("demo", Some(Version(3))))), None);
        assert_eq!(
            refusal(Some(&spec("demo", Some(VersionLabel("3".into()))))),
            None
        );
        let not_found = |what: &str| {
            Some((
                Code::NotFound,
                format!("Servable not found for request: {what}"),
            ))
        };
        assert_eq!(
            refusal(Some(&spec("nope", None))),
            not_found("Latest(nope)")
        );
        assert_eq!(
            refusal(Some(&spec("demo", Some(Version(7))))),
            not_found("Specific(demo, 7)")
        );
        assert_eq!(
            refusal(Some(&spec("nope", Some(Version(3))))),
            not_found("Specific(nope, 3)")
        );
        assert_eq!(
            refusal(Some(&spec("nope", Some(VersionLabel("3".into()))))),
            not_found("Latest(nope)")
        );
        assert_eq!(
            refusal(Some(&spec("demo", Some(VersionLabel("stable".into()))))),
            Some((
                Code::InvalidArgument,
                "Unrecognized servable version label: stable".to_string()
            ))
        );
        let no_name = Some((
            Code::InvalidArgument,
            "ModelSpec has no name specified.".to_string(),
        ));
        assert_eq!(refusal(None), no_name);
        assert_eq!(refusal(Some(&spec("", Some(Version(3))))), no_name);
    }

    #[test]
    fn status_specs_are_checked_as_tf_serving_does() {
        use VersionChoice::{Version, VersionLabel};
        let refusal = |spec: Option<&ModelSpec>| {
            models()
                .status(spec, |_| true)
                .err()
                .map(|e| (e.code, e.message))
        };
        assert_eq!(refusal(Some(&spec("demo", None))), None);
        assert_eq!(refusal(Some(&spec("demo", Some(Version(3))))), None);
        assert_eq!(
            refusal(Some(&spec("demo", Some(VersionLabel("x".into()))))),
            None
        );
        let not_found = |text: &str| Some((Code::NotFound, text.to_string()));
        assert_eq!(
            refusal(Some(&spec("nope", None))),
            not_found("Could not find any versions of model nope")
        );
        assert_eq!(
            refusal(Some(&spec("demo", Some(Version(7))))),
            not_found("Could not find version 7 of model demo")
        );
        assert_eq!(
            refusal(Some(&spec("nope", Some(Version(3))))),
            not_found("Could not find version 3 of model nope")
        );
        assert_eq!(
            refusal(None),
            Some((Code::InvalidArgument, "Missing ModelSpec".to_string()))
        );
    }

    #[test]
    fn grpc_timeouts_parse_as_the_protocol_says() {
        let now = Instant::now();
        let mut metadata = tonic::metadata::MetadataMap::new();
        assert_eq!(deadline_of(&metadata, now), None);
        metadata.insert("grpc-timeout", "250m".parse().unwrap());
        assert_eq!(
            deadline_of(&metadata, now),
            Some(now + Duration::from_millis(250))
        );
        metadata.insert("grpc-timeout", "3S".parse().unwrap());
        assert_eq!(
            deadline_of(&metadata, now),
            Some(now + Duration::from_secs(3))
        );
        metadata.insert("grpc-timeout", "123456789S".parse().unwrap());
        assert_eq!(deadline_of(&metadata, now), None, "more than 8 digits");
        metadata.insert("grpc-timeout", "5x".parse().unwrap());
        assert_eq!(deadline_of(&metadata, now), None);
        // Digits only: u64's parse took a sign.
        metadata.insert("grpc-timeout", "+5S".parse().unwrap());
        assert_eq!(deadline_of(&metadata, now), None, "a sign is no digit");
    }
}
