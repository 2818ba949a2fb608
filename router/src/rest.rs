//! TF Serving's REST API (`http_rest_api_handler.cc`), on its own port, over the same checked
//! paths as the gRPC API (`grpc::Api`), so both answer alike:
//! - `POST /v1/models/{name}[/versions/{v}|/labels/{l}]:predict` (row or columnar JSON,
//!   `json_tensor`), `:classify` and `:regress` (tf.Examples as JSON objects, `inference`);
//! - `GET /v1/models/{name}[/versions/{v}|/labels/{l}]` (status) and `.../metadata`.
//!
//! Every answer is JSON; an error is `{"error": message}` with TF Serving's HTTP status for
//! its code. A body over the message limit is refused before it is read.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Buf, Bytes};
use http_body_util::{BodyExt, Full};
use hyper::{Method as HttpMethod, Request, Response, StatusCode};
use percent_encoding::percent_decode_str;
use prost::Message;
use tokio::time::Instant;

use crate::decode_budget::{self, input_memory, tensor_memory};
use crate::grpc::Api;
use crate::json_tensor::{self, write_string};
use crate::metrics::{Entrypoint, Method, TfApi};
use crate::proto::mpspool::tfs::{
    model_spec::VersionChoice, model_version_status, GetModelMetadataRequest,
    GetModelStatusRequest, ModelSpec, PredictRequest, SignatureDefMap, TensorInfo, TensorProto,
    TensorShapeProto,
};
use crate::proto::tensorflow::serving::{ClassificationRequest, Input, RegressionRequest};
use crate::request_body::{Framing, ReadError, Reading};
use crate::request_budget::{self, Held, RequestBudget};
use crate::rest_conn::WatchedBody;
use crate::status::{Code, ServingError};

/// What the REST handlers share.
pub struct Rest {
    api: Api,
    /// Largest body accepted (the gRPC message limit).
    max_body_bytes: usize,
    /// TF Serving's `--rest_api_timeout_in_ms`: each Predict's deadline.
    timeout: Option<Duration>,
    /// Where TF Serving's metrics are served (its monitoring config's Prometheus path).
    prometheus_path: Option<String>,
    /// What the requests may take together (bodies being read, JSON documents being parsed,
    /// requests built and waiting for their answers), shared with gRPC's; and how long a
    /// request may stall (request_body).
    reading: Reading,
    /// TF Serving's `--rest_api_enable_cors_support`.
    cors: bool,
}

/// A body read whole, with the share of the budget its bytes hold (request_body; None for a
/// small one), given back with the bytes.
pub struct ReadBody {
    bytes: Bytes,
    held: Option<Held>,
}

impl From<Bytes> for ReadBody {
    fn from(bytes: Bytes) -> Self {
        Self { bytes, held: None }
    }
}

/// A body at least this large is parsed (and its tensors built) on tokio's blocking threads:
/// parsing megabytes of JSON takes milliseconds to seconds, during which the thread serving
/// every other request (gRPC's too) would stand still. Smaller ones (a batch-256 request of
/// the demo model is ~64 KiB, ~1 ms to parse) stay in place, where the hand-off to another
/// thread and back would be a good part of the work.
const BLOCKING_BODY_BYTES: usize = 256 * 1024;

/// A body's buffer is first made this large, or as large as its declared length if less.
const FIRST_BODY_BYTES: usize = 1 << 20;

/// A body parsed in place whose document could cost at most this part of the budget reserves
/// that without being read for it: 1/16 of the default 2 GiB (4 x 512 MiB messages) is every
/// body up to ~200 KiB; of the 256 MiB floor, up to ~25 KiB.
const UNREAD_SHARE: usize = 16;

/// An answer whose tensors hold at least this many bytes is written as JSON on tokio's
/// blocking threads: a number prints as up to ~16 characters against its 4 to 8 bytes, so this
/// is a document of some hundreds of KiB, a millisecond's writing and more; a 100 MB answer
/// took seconds, every other request (gRPC's too) waiting behind it on a front door of one
/// thread (found by a client test).
const BLOCKING_ANSWER_BYTES: usize = BLOCKING_BODY_BYTES / 8;

/// The most JSON arrays an answer is written as (2 GiB of brackets at least): an empty
/// tensor's are all it holds, so its bytes said nothing of them, and a model's
/// `tf.zeros([n, m, 0])` made a 26-byte request a 400 MB answer written on the serving
/// thread (found by a hunt).
const MAX_ANSWER_ARRAYS: u64 = 1 << 30;

tokio::task_local! {
    /// The share of the request budget the answer being made holds (`hold_answer`), for its
    /// connection to keep with the answer's body until it is written (`HeldAnswer`).
    static ANSWER_HELD: RefCell<Option<Held>>;
}

/// Holds `json` bytes of the budget for the answer being made (an API call's JSON), taking
/// over `carried` (the request body's share); RESOURCE_EXHAUSTED when the answer is larger
/// than the budget or the budget has not the room, as a gRPC answer's (answer_body). Outside
/// a connection's scope (tests) nothing is held. REST answers were counted by nothing: four
/// 60-byte requests of 20,000,000 floats each made a 420 MB answer, 2.4 GB at once, and
/// clients that read none held them until their connections' stall limit (found by a hunt).
fn hold_answer(
    carried: Option<Held>,
    json: usize,
    budget: &RequestBudget,
) -> Result<(), ServingError> {
    if json < decode_budget::UNCOUNTED_BYTES || ANSWER_HELD.try_with(|_| ()).is_err() {
        return Ok(());
    }
    let held = crate::answer_body::take_over(carried, json, budget)?;
    let _ = ANSWER_HELD.try_with(|answer| *answer.borrow_mut() = Some(held));
    Ok(())
}

/// An answer's body, handed to hyper a piece at a time, each a copy, with its share of the
/// budget held until the last piece is taken: hyper queues a few pieces ahead of the socket
/// (300-900 KB measured), so what a client does not read stays counted, all but those. A
/// whole body handed over at once was dropped, and its share with it, while hyper still held
/// every byte; pieces sliced from the answer kept all of it alive through the last few
/// (found by a review), as the gRPC answer's copied pieces do not (answer_body).
pub struct HeldAnswer {
    rest: Bytes,
    held: Option<Held>,
}

impl HeldAnswer {
    fn new(rest: Bytes, held: Option<Held>) -> Self {
        Self { rest, held }
    }
}

impl hyper::body::Body for HeldAnswer {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, Self::Error>>> {
        let this = self.get_mut();
        if this.rest.is_empty() {
            this.held = None;
            return std::task::Poll::Ready(None);
        }
        let size = this.rest.len().min(crate::answer_body::PIECE);
        let piece = Bytes::copy_from_slice(&this.rest[..size]);
        this.rest.advance(size);
        if this.rest.is_empty() {
            this.rest = Bytes::new(); // the answer's buffer goes now, its share with it
            this.held = None;
        }
        std::task::Poll::Ready(Some(Ok(hyper::body::Frame::data(piece))))
    }

    fn is_end_stream(&self) -> bool {
        self.rest.is_empty()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        hyper::body::SizeHint::with_exact(self.rest.len() as u64)
    }
}

/// JSON arrays a tensor is written as: [2, 3, 4] is 1 + 2 + 2·3 (its innermost arrays hold
/// the values), a scalar none.
fn json_arrays(tensor: &TensorProto) -> u64 {
    let dims = tensor.tensor_shape.as_ref().map_or(&[][..], |s| &s.dim[..]);
    let mut arrays = 0u64;
    let mut outer = 1u64;
    for dim in dims {
        arrays = arrays.saturating_add(outer);
        outer = outer.saturating_mul(dim.size.max(0) as u64);
    }
    arrays
}

/// `work` (on a body of `size` bytes) where it holds up no other request: in place for a
/// small body, on a blocking thread for a large one.
async fn off_the_serving_thread<T: Send + 'static>(
    size: usize,
    work: impl FnOnce() -> Result<T, ServingError> + Send + 'static,
) -> Result<T, ServingError> {
    on_a_blocking_thread_if(
        size >= BLOCKING_BODY_BYTES,
        "parsing the request body",
        work,
    )
    .await
}

/// `work`, on one of tokio's blocking threads when `large`, in place otherwise; INTERNAL,
/// saying `what` failed, if its thread panicked.
pub(crate) async fn on_a_blocking_thread_if<T: Send + 'static>(
    large: bool,
    what: &str,
    work: impl FnOnce() -> Result<T, ServingError> + Send + 'static,
) -> Result<T, ServingError> {
    if !large {
        return work();
    }
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|error| ServingError::new(Code::Internal, format!("{what} failed: {error}")))?
}

/// `work` (parsing `body` and whatever reads its document) holding the document's share of
/// `budget` while it runs; its result, and the part of the share it keeps: the bytes `work`
/// says what it built holds, to hold until the request is answered. A body smaller than
/// BLOCKING_BODY_BYTES reserves its document's cost (the most it could be, unread, where that
/// is a small part of the budget: UNREAD_SHARE) if the budget has that free at once, and is
/// worked on in place. Otherwise the body is read for its cost (refused if that alone is over
/// the budget), waits for it until `deadline` (first come, first served: behind a large body
/// that waits, smaller ones wait too), and is worked on in place if small, on a blocking
/// thread if large.
async fn parse_within<T: Send + 'static>(
    budget: &RequestBudget,
    body: ReadBody,
    deadline: Option<Instant>,
    work: impl FnOnce(&[u8]) -> Result<(T, usize), ServingError> + Send + 'static,
) -> Result<(T, Held), ServingError> {
    let kept = |held, (built, bytes)| (built, request_budget::keep(held, bytes));
    // The body's own share is kept while it is parsed, and given back before a wait.
    let ReadBody {
        bytes: body,
        held: read,
    } = body;
    if body.len() < BLOCKING_BODY_BYTES {
        // gRPC shares the budget and cannot wait for it: a body reserves the most its document
        // could cost (641 times its size) only where that is a small part of the budget, held
        // for the parse's milliseconds by one parse per runtime thread at most (the work runs
        // right here, with no await); others are read for their cost first, a pass that costs
        // a good part of the parse (12-28% more front-door CPU per batch-256 body, measured).
        let most = json_tensor::most_parse_cost(body.len());
        let cost = if most <= budget.bytes() / UNREAD_SHARE {
            most
        } else {
            json_tensor::parse_cost(&body).bytes()
        };
        if let Some(held) = budget.try_reserve(cost) {
            return work(&body).map(|built| kept(held, built));
        }
    }
    let (body, cost) = off_the_serving_thread(body.len(), move || {
        let cost = json_tensor::parse_cost(&body);
        Ok((body, cost))
    })
    .await?;
    cost.check(budget.bytes())?;
    let (held, read) = match budget.try_reserve(cost.bytes()) {
        Some(held) => (held, read),
        // Waits holding nothing (bodies holding shares while they wait for room could wait
        // for each other for ever): its bytes go uncounted until it has room. Bodies read
        // later wait behind it for theirs (first come, first served), so the bodies waiting
        // here were all let in by the budget.
        None => {
            drop(read);
            (budget.reserve(cost.bytes(), deadline).await?, None)
        }
    };
    // The reservations move with the work: a request given up while it runs (the client
    // gone) leaves the work running, and its shares held, until it ends.
    off_the_serving_thread(body.len(), move || {
        let _read = read;
        work(&body).map(|built| kept(held, built))
    })
    .await
}

/// A Classify or Regress body's examples, and what they hold (parse_within's `work`).
fn parse_examples(body: &[u8]) -> Result<((String, Input), usize), ServingError> {
    let (signature_name, input) = json_tensor::parse_examples(body)?;
    let bytes = input_memory(&input);
    Ok(((signature_name, input), bytes))
}

/// The version part of a path.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Version {
    Latest,
    Number(i64),
    Label(String),
}

/// What a path asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Route {
    /// POST ...:predict / :classify / :regress
    Call {
        model: String,
        version: Version,
        method: String,
    },
    /// GET ... and GET .../metadata
    Status {
        model: String,
        version: Version,
    },
    Metadata {
        model: String,
        version: Version,
    },
}

fn decode(text: &str, what: &str) -> Result<String, ServingError> {
    percent_decode_str(text)
        .decode_utf8()
        .map(|s| s.into_owned())
        .map_err(|_| ServingError::invalid_argument(format!("Failed to decode {what}:{text}")))
}

/// The methods TF Serving's HTTP server lets through (evhttp_server.cc sets them with
/// evhttp_set_allowed_methods); libevent answers any other, an unknown token too, with 501.
fn libevent_takes(method: &HttpMethod) -> bool {
    [
        HttpMethod::GET,
        HttpMethod::POST,
        HttpMethod::HEAD,
        HttpMethod::PUT,
        HttpMethod::DELETE,
        HttpMethod::OPTIONS,
        HttpMethod::PATCH,
    ]
    .contains(method)
}

fn is_name(segment: &str) -> bool {
    !segment.is_empty() && !segment.contains(':')
}

/// The version segments after a model name: none, `versions/<digits>` or `labels/<label>`.
fn version_of(segments: &[&str]) -> Result<Option<Version>, ServingError> {
    match segments {
        [] => Ok(Some(Version::Latest)),
        [kind, value] if kind.eq_ignore_ascii_case("versions") => {
            if value.is_empty() || !value.bytes().all(|b| b.is_ascii_digit()) {
                return Ok(None);
            }
            value
                .parse()
                .map(|v| Some(Version::Number(v)))
                .map_err(|_| {
                    ServingError::invalid_argument(format!(
                        "Failed to convert version: {value} to numeric."
                    ))
                })
        }
        [kind, label] if kind.eq_ignore_ascii_case("labels") && is_name(label) => {
            Ok(Some(Version::Label(decode(label, "model version label")?)))
        }
        _ => Ok(None),
    }
}

/// TF Serving's `ParseModelInfo`: None when the path matches neither of its patterns.
fn route(method: &HttpMethod, path: &str) -> Result<Option<Route>, ServingError> {
    let lower = path.to_ascii_lowercase();
    if !lower.starts_with("/v1/models") {
        return Ok(None);
    }
    let rest = &path["/v1/models".len()..];
    if *method == HttpMethod::POST {
        let Some(rest) = rest.strip_prefix('/') else {
            return Ok(None);
        };
        let Some((target, call)) = rest.split_once(':') else {
            return Ok(None);
        };
        if !["predict", "classify", "regress"].contains(&call) {
            return Ok(None);
        }
        let segments: Vec<&str> = target.split('/').collect();
        let Some((name, more)) = segments.split_first().filter(|(n, _)| is_name(n)) else {
            return Ok(None);
        };
        let Some(version) = version_of(more)? else {
            return Ok(None);
        };
        return Ok(Some(Route::Call {
            model: decode(name, "model name")?,
            version,
            method: call.to_string(),
        }));
    }
    if *method != HttpMethod::GET {
        return Ok(None);
    }
    if rest.is_empty() {
        return Ok(Some(Route::Status {
            model: String::new(),
            version: Version::Latest,
        }));
    }
    let Some(rest) = rest.strip_prefix('/') else {
        return Ok(None);
    };
    let segments: Vec<&str> = rest.split('/').collect();
    let Some((name, more)) = segments.split_first().filter(|(n, _)| is_name(n)) else {
        return Ok(None);
    };
    // TF Serving's pattern ends in an optional `/metadata` (any case, `(?i)`) after an
    // optional version part, and prefers the version part: `.../labels/metadata` is the
    // status by the label "metadata", `.../labels/x/metadata` the metadata by "x". Its
    // handler answers metadata for the lowercase word only; `/METADATA` is a status.
    let version = match version_of(more)? {
        Some(version) => Some((version, false)),
        None => match more.split_last() {
            Some((last, before)) if last.eq_ignore_ascii_case("metadata") => {
                version_of(before)?.map(|version| (version, *last == "metadata"))
            }
            _ => None,
        },
    };
    let Some((version, metadata)) = version else {
        return Ok(None);
    };
    let model = decode(name, "model name")?;
    Ok(Some(if metadata {
        Route::Metadata { model, version }
    } else {
        Route::Status { model, version }
    }))
}

fn model_spec(model: &str, version: &Version, signature_name: &str) -> ModelSpec {
    ModelSpec {
        name: model.to_string(),
        version_choice: match version {
            Version::Latest => None,
            Version::Number(v) => Some(VersionChoice::Version(*v)),
            Version::Label(label) => Some(VersionChoice::VersionLabel(label.clone())),
        },
        signature_name: signature_name.to_string(),
    }
}

fn read_failed(error: &dyn std::fmt::Display) -> Response<Full<Bytes>> {
    error_response(&ServingError::invalid_argument(format!(
        "cannot read the request body: {error}"
    )))
}

/// TF Serving's `ToHTTPStatusCode`.
fn http_status(code: Code) -> StatusCode {
    let number = match code {
        Code::Ok => 200,
        Code::Cancelled => 499,
        Code::InvalidArgument | Code::FailedPrecondition | Code::OutOfRange => 400,
        Code::DeadlineExceeded => 504,
        Code::NotFound => 404,
        Code::AlreadyExists | Code::Aborted => 409,
        Code::PermissionDenied => 403,
        Code::ResourceExhausted => 429,
        Code::Unimplemented => 501,
        Code::Unavailable => 503,
        Code::Unauthenticated => 401,
        Code::Unknown | Code::Internal | Code::DataLoss => 500,
    };
    StatusCode::from_u16(number).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
}

fn json_response(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/json"),
    );
    response
}

/// TF Serving's answer to a CORS preflight on its REST paths, given whether or not CORS is on
/// (http_server.cc): an empty 200 when `Origin` names an http(s) origin, else an empty 400
/// (FAILED_PRECONDITION, "Origin header is missing in CORS preflight", said only in its log).
fn preflight(headers: &hyper::HeaderMap) -> Response<Full<Bytes>> {
    let origin = headers
        .get(hyper::header::ORIGIN)
        .and_then(|value| value.to_str().ok())
        .unwrap_or_default();
    let mut response = Response::new(Full::new(Bytes::new()));
    // RE2::PartialMatch(origin, "https?://"): anywhere in the header.
    if !(origin.contains("http://") || origin.contains("https://")) {
        *response.status_mut() = StatusCode::BAD_REQUEST;
    }
    response
}

/// TF Serving's `AddCORSHeaders` (http_rest_api_util.cc).
fn add_cors_headers(headers: &mut hyper::HeaderMap) {
    use hyper::header::{
        HeaderValue, ACCESS_CONTROL_ALLOW_HEADERS, ACCESS_CONTROL_ALLOW_METHODS,
        ACCESS_CONTROL_ALLOW_ORIGIN,
    };
    headers.insert(ACCESS_CONTROL_ALLOW_ORIGIN, HeaderValue::from_static("*"));
    headers.insert(
        ACCESS_CONTROL_ALLOW_METHODS,
        HeaderValue::from_static("POST, GET"),
    );
    headers.insert(
        ACCESS_CONTROL_ALLOW_HEADERS,
        HeaderValue::from_static("Content-Type"),
    );
}

/// Whether a body comes gzipped: its Content-Encoding names gzip ("gzip", "x-gzip"), as TF
/// Serving's HTTP server tests it (`NeedUncompressGzipContent`: the header contains "gzip";
/// its `auto_uncompress_input` is on by default). Other encodings are read as they come, as
/// there.
fn gzipped(headers: &hyper::HeaderMap) -> bool {
    headers
        .get_all(hyper::header::CONTENT_ENCODING)
        .iter()
        .any(|value| {
            value
                .as_bytes()
                .windows(4)
                .any(|w| w.eq_ignore_ascii_case(b"gzip"))
        })
}

/// Why a gzipped body could not be read.
#[derive(Debug)]
enum Gunzip {
    /// Uncompressed, it passes the body limit (413, as a plain body that long).
    TooLarge,
    /// Not gzip (400), or the budget had no room for it (429).
    Refused(ServingError),
}

/// Uncompress steps: the memory a step reads into is counted against the budget first.
const GUNZIP_STEP: usize = 64 * 1024;

/// A gzipped body at least this long is uncompressed on a blocking thread: gzip shrinks
/// JSON's repeats up to ~1000 times, so a few KiB may stand for megabytes of document.
const BLOCKING_GZIP_BYTES: usize = 4 * 1024;

/// `read`'s body uncompressed (gzip members, one or several), holding the budget's share of
/// both forms while it is built: a small body can stand for a large document (1 KiB of gzip
/// for 1 MiB of JSON), so the memory its uncompressed bytes take is counted before they are
/// read, and refused past `limit` (the body limit, which applies to what is parsed) or past
/// what the budget has free at once. A gzipped body does not wait for room as a plain one
/// does: under memory pressure it is refused (429, "try again later") where a plain one of
/// that size would wait.
fn gunzip(read: ReadBody, limit: usize, budget: &RequestBudget) -> Result<ReadBody, Gunzip> {
    use std::io::Read as _;
    let ReadBody {
        bytes: compressed,
        mut held,
    } = read;
    let mut decoder = flate2::read::MultiGzDecoder::new(&compressed[..]);
    let mut out: Vec<u8> = Vec::new();
    loop {
        let start = out.len();
        // Counted at what it will hold, grown as a Vec grows (doubling), not at its length.
        let needed = start + GUNZIP_STEP;
        let room = if needed > out.capacity() {
            needed.max(out.capacity() * 2)
        } else {
            out.capacity()
        };
        let counted = compressed.len() + room;
        held = Some(
            request_budget::resize(held, counted, budget)
                .ok_or_else(|| Gunzip::Refused(budget.no_room("uncompressing this body", start)))?,
        );
        out.reserve_exact(room - start);
        out.resize(start + GUNZIP_STEP, 0);
        let n = decoder.read(&mut out[start..]).map_err(|error| {
            Gunzip::Refused(ServingError::invalid_argument(format!(
                "Failed to uncompress the gzipped body: {error}"
            )))
        })?;
        out.truncate(start + n);
        if out.len() > limit {
            return Err(Gunzip::TooLarge);
        }
        if n == 0 {
            break;
        }
    }
    drop(decoder);
    drop(compressed);
    // Its spare capacity given back before it is kept (Bytes keeps a Vec's whole allocation).
    out.shrink_to_fit();
    let bytes = Bytes::from(out);
    Ok(ReadBody {
        held: held.map(|held| request_budget::keep(held, bytes.len())),
        bytes,
    })
}

fn error_response(error: &ServingError) -> Response<Full<Bytes>> {
    json_response(
        http_status(error.code),
        json_tensor::error_body(&error.message),
    )
}

impl Rest {
    /// The REST API over `api`, taking bodies of up to `max_body_bytes`, its requests' memory
    /// held to `budget` (serde_json's document of a small-valued JSON body is 30-90 times its
    /// size: json_tensor::parse_cost).
    pub fn new(
        api: Api,
        max_body_bytes: usize,
        reading: Reading,
        timeout: Option<Duration>,
        prometheus_path: Option<String>,
        cors: bool,
    ) -> Self {
        Self {
            api,
            max_body_bytes,
            timeout,
            prometheus_path,
            reading,
            cors,
        }
    }

    /// One HTTP request: never fails (errors are JSON answers).
    pub async fn handle(&self, request: Request<WatchedBody>) -> Response<Full<Bytes>> {
        let method = request.method().clone();
        if !libevent_takes(&method) {
            // 501 before any route, as libevent (TF Serving's HTTP server) answers a method
            // it was not told to take. (A 200 to CONNECT, from the metrics page, had hyper
            // take the connection for a tunnel and close it.)
            let mut response = Response::new(Full::new(Bytes::new()));
            *response.status_mut() = StatusCode::NOT_IMPLEMENTED;
            return response;
        }
        // TF Serving's handlers read the path with its query (EvHTTPRequest::uri_path is
        // path_and_query): `:predict?x=1` is a malformed request there, not a predict.
        let path = request.uri().path_and_query().map_or_else(
            || request.uri().path().to_string(),
            |p| p.as_str().to_string(),
        );
        // Any other method, as TF Serving's HTTP server finds the page by its path alone (a
        // HEAD gets the headers only: hyper leaves a HEAD answer's body out); its handler
        // then refuses a query (ProcessPrometheusRequest: 400, "Unexpected path").
        if let Some(page) = self
            .prometheus_path
            .as_deref()
            .filter(|page| *page == request.uri().path())
        {
            let (status, body, kind) = if path == page {
                let page = self.api.metrics.render_tf_serving();
                (StatusCode::OK, page, "text/plain; version=0.0.4")
            } else {
                let said = format!("Unexpected path: {path}. Should be {page}");
                (StatusCode::BAD_REQUEST, said, "text/plain")
            };
            let mut response = Response::new(Full::new(Bytes::from(body)));
            *response.status_mut() = status;
            response.headers_mut().insert(
                hyper::header::CONTENT_TYPE,
                hyper::header::HeaderValue::from_static(kind),
            );
            return response;
        }
        // What TF Serving's REST dispatcher takes (kHTTPRestApiHandlerPathRegex, "(?i)/v1/.*")
        // gets its CORS headers when they are on, errors included (http_server.cc).
        let api_path = path
            .get(..4)
            .is_some_and(|head| head.eq_ignore_ascii_case("/v1/"));
        let mut response = if method == HttpMethod::OPTIONS && api_path {
            preflight(request.headers())
        } else {
            self.answer(request, method, path, api_path).await
        };
        if self.cors && api_path {
            add_cors_headers(response.headers_mut());
        }
        response
    }

    async fn answer(
        &self,
        request: Request<WatchedBody>,
        method: HttpMethod,
        path: String,
        // Under /v1/ (TF Serving's REST dispatcher), worked out once by `handle`.
        api_path: bool,
    ) -> Response<Full<Bytes>> {
        let route = match route(&method, &path) {
            Ok(Some(route)) => route,
            Ok(None) if api_path => {
                return error_response(&ServingError::invalid_argument(format!(
                    "Malformed request: {method} {path}"
                )))
            }
            Ok(None) => {
                return json_response(
                    StatusCode::NOT_FOUND,
                    json_tensor::error_body(&format!("Not found: {method} {path}")),
                )
            }
            Err(error) => return error_response(&error),
        };
        let answer = match route {
            Route::Call {
                model,
                version,
                method,
            } => {
                // Waiting for room to read the body counts against the REST timeout; the
                // call's own deadline starts once the body is read.
                let room_by = self.timeout.map(|t| Instant::now() + t);
                let body = match self.read_body(request, room_by).await {
                    Ok(body) => body,
                    Err(response) => return response,
                };
                self.call(&model, &version, &method, body).await
            }
            Route::Status { model, version } => {
                let mut guard = self.api.metrics.start(Method::GetModelStatus);
                // TF Serving counts every REST request that names a model (http_server.cc).
                if let Some(served) = self.api.served_model(&model) {
                    guard.tf_serving(served, TfApi::Get, Entrypoint::Rest);
                }
                let answer = self.status(&model, &version);
                guard.set_code(answer.as_ref().err().map_or(Code::Ok, |e| e.code));
                answer
            }
            Route::Metadata { model, version } => {
                let mut guard = self.api.metrics.start(Method::GetModelMetadata);
                if let Some(served) = self.api.served_model(&model) {
                    guard.tf_serving(served, TfApi::Get, Entrypoint::Rest);
                }
                let answer = self.metadata(&model, &version);
                guard.set_code(answer.as_ref().err().map_or(Code::Ok, |e| e.code));
                answer
            }
        };
        match answer {
            Ok(body) => json_response(StatusCode::OK, body),
            Err(error) => error_response(&error),
        }
    }

    /// `work` on `body` (parse_within) under this front door's request budget.
    async fn parse_body<T: Send + 'static>(
        &self,
        body: ReadBody,
        deadline: Option<Instant>,
        work: impl FnOnce(&[u8]) -> Result<(T, usize), ServingError> + Send + 'static,
    ) -> Result<(T, Held), ServingError> {
        parse_within(&self.reading.budget, body, deadline, work).await
    }

    /// The whole body and its share of the budget; or a 413 answer when it is (or declares
    /// itself) over the limit, 504 when the budget had no room for its bytes as they came by
    /// `room_by` (request_body: a length is not reserved before them), 408 when it stopped
    /// arriving.
    async fn read_body(
        &self,
        request: Request<WatchedBody>,
        room_by: Option<Instant>,
    ) -> Result<ReadBody, Response<Full<Bytes>>> {
        let limit = self.max_body_bytes;
        let too_large = |size: Option<u64>| {
            let body = size.map_or("Request body".to_string(), |n| {
                format!("Request body of {n} bytes")
            });
            json_response(
                StatusCode::PAYLOAD_TOO_LARGE,
                json_tensor::error_body(&format!(
                    "{body} is larger than the limit of {limit} bytes"
                )),
            )
        };
        let gzipped = gzipped(request.headers());
        let declared = request
            .headers()
            .get(hyper::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if let Some(size) = declared.filter(|&n| n > limit as u64) {
            return Err(too_large(Some(size)));
        }
        let mut body = self
            .reading
            .body(request.into_body(), Framing::Whole)
            .waiting_for_room(room_by);
        let error = match whole_body(&mut body, limit, declared).await {
            Ok(Some(bytes)) => {
                let read = ReadBody {
                    bytes,
                    held: body.take_held(),
                };
                if !gzipped {
                    return Ok(read);
                }
                let budget = self.reading.budget.clone();
                let large = read.bytes.len() >= BLOCKING_GZIP_BYTES;
                let uncompressed = on_a_blocking_thread_if(large, "uncompressing the body", {
                    move || Ok(gunzip(read, limit, &budget))
                });
                return match uncompressed.await {
                    Ok(Ok(read)) => Ok(read),
                    Ok(Err(Gunzip::TooLarge)) => Err(too_large(None)),
                    Ok(Err(Gunzip::Refused(error))) | Err(error) => Err(error_response(&error)),
                };
            }
            Ok(None) => return Err(too_large(None)),
            Err(error) => error,
        };
        Err(match error {
            ReadError::Refused(error) => error_response(&error),
            ReadError::Stalled(error) => json_response(
                StatusCode::REQUEST_TIMEOUT,
                json_tensor::error_body(&error.message),
            ),
            ReadError::Body(error) => read_failed(&error),
        })
    }

    async fn call(
        &self,
        model: &str,
        version: &Version,
        method: &str,
        body: ReadBody,
    ) -> Result<String, ServingError> {
        let deadline = self.timeout.map(|t| Instant::now() + t);
        let kind = match method {
            "classify" => Method::Classify,
            "regress" => Method::Regress,
            _ => Method::Predict,
        };
        let mut guard = self.api.metrics.start(kind);
        if let Some(served) = self.api.served_model(model) {
            let api = match kind {
                Method::Classify => TfApi::Classify,
                Method::Regress => TfApi::Regress,
                _ => TfApi::Predict,
            };
            guard.tf_serving(served, api, Entrypoint::Rest);
        }
        let answer = match kind {
            Method::Classify => self.classify(model, version, body, deadline).await,
            Method::Regress => self.regress(model, version, body, deadline).await,
            _ => self.predict(model, version, body, deadline).await,
        };
        guard.set_code(answer.as_ref().err().map_or(Code::Ok, |e| e.code));
        answer
    }

    /// TF Serving's `ProcessClassifyRequest`.
    async fn classify(
        &self,
        model: &str,
        version: &Version,
        body: ReadBody,
        deadline: Option<Instant>,
    ) -> Result<String, ServingError> {
        let ((signature_name, input), held) =
            self.parse_body(body, deadline, parse_examples).await?;
        let request = ClassificationRequest {
            model_spec: Some(model_spec(model, version, &signature_name)),
            input: Some(input),
        };
        let (response, held) =
            decode_budget::serving_with(held, self.api.classify_checked(request, deadline)).await;
        let answer = json_tensor::classification_answer(&response?.result.unwrap_or_default())?;
        hold_answer(held, answer.len(), &self.reading.budget)?;
        Ok(answer)
    }

    /// TF Serving's `ProcessRegressRequest`.
    async fn regress(
        &self,
        model: &str,
        version: &Version,
        body: ReadBody,
        deadline: Option<Instant>,
    ) -> Result<String, ServingError> {
        let ((signature_name, input), held) =
            self.parse_body(body, deadline, parse_examples).await?;
        let request = RegressionRequest {
            model_spec: Some(model_spec(model, version, &signature_name)),
            input: Some(input),
        };
        let (response, held) =
            decode_budget::serving_with(held, self.api.regress_checked(request, deadline)).await;
        let answer = json_tensor::regression_answer(&response?.result.unwrap_or_default())?;
        hold_answer(held, answer.len(), &self.reading.budget)?;
        Ok(answer)
    }

    /// TF Serving's `ProcessPredictRequest`: the body is parsed first, then the model and
    /// signature are looked up, then the tensors are read against the signature's inputs.
    async fn predict(
        &self,
        model: &str,
        version: &Version,
        body: ReadBody,
        deadline: Option<Instant>,
    ) -> Result<String, ServingError> {
        // Everything that reads the body's document runs under its share of the request budget,
        // building the tensors too: the document lives until they are built.
        let api = self.api.clone();
        let (model, version) = (model.to_string(), version.clone());
        let ((spec, inputs, format), held) = self
            .parse_body(body, deadline, move |body| {
                let parsed = json_tensor::parse_predict(body)?;
                let spec = model_spec(&model, &version, &parsed.signature_name);
                let signatures = api.signatures(api.resolve(Some(&spec))?)?;
                let signature_inputs = signatures.rest_inputs(&parsed.signature_name)?;
                let (inputs, format) = parsed.tensors(&signature_inputs)?;
                let bytes = inputs.values().map(tensor_memory).sum();
                Ok(((spec, inputs, format), bytes))
            })
            .await?;
        let request = PredictRequest {
            model_spec: Some(spec),
            inputs: inputs.into_iter().collect(),
            output_filter: Vec::new(),
        };
        // The body's share goes with the work (to a worker, and stays there if this caller
        // goes), and back here while the answer is written.
        let (response, held) =
            decode_budget::serving_with(held, self.api.predict_checked(request, deadline, false))
                .await;
        let response = response?;
        let outputs: BTreeMap<_, _> = response.outputs.into_iter().collect();
        let arrays = outputs
            .values()
            .fold(0u64, |sum, t| sum.saturating_add(json_arrays(t)));
        if arrays > MAX_ANSWER_ARRAYS {
            return Err(ServingError::new(
                Code::ResourceExhausted,
                format!(
                    "the answer's outputs would be written as {arrays} JSON arrays, more than \
                     {MAX_ANSWER_ARRAYS}"
                ),
            ));
        }
        let size: usize = outputs.values().map(tensor_memory).sum();
        let size =
            size.saturating_add(usize::try_from(arrays.saturating_mul(2)).unwrap_or(usize::MAX));
        let answer = on_a_blocking_thread_if(
            size >= BLOCKING_ANSWER_BYTES,
            "writing the answer",
            move || json_tensor::predict_answer(&outputs, format),
        )
        .await?;
        hold_answer(held, answer.len(), &self.reading.budget)?;
        Ok(answer)
    }

    fn status(&self, model: &str, version: &Version) -> Result<String, ServingError> {
        if model.is_empty() {
            return Err(ServingError::invalid_argument(
                "Missing model name in request.",
            ));
        }
        let request = GetModelStatusRequest {
            model_spec: Some(model_spec(model, version, "")),
        };
        let response = self.api.status_checked(&request)?;
        let mut out = String::from("{\n \"model_version_status\": [");
        for (i, status) in response.model_version_status.iter().enumerate() {
            out.push_str(if i > 0 { ",\n  {" } else { "\n  {" });
            let state = model_version_status::State::try_from(status.state)
                .map_or("UNKNOWN", |s| s.as_str_name());
            let (code, message) = status
                .status
                .as_ref()
                .map_or((0, ""), |s| (s.error_code, s.error_message.as_str()));
            let _ = write!(
                out,
                "\n   \"version\": \"{}\",\n   \"state\": \"{state}\",\n   \"status\": {{\n    \"error_code\": \"{}\",\n    \"error_message\": ",
                status.version,
                Code::from_i32(code).name()
            );
            write_string(&mut out, message.as_bytes());
            out.push_str("\n   }\n  }");
        }
        out.push_str("\n ]\n}\n");
        Ok(out)
    }

    fn metadata(&self, model: &str, version: &Version) -> Result<String, ServingError> {
        if model.is_empty() {
            return Err(ServingError::invalid_argument(
                "Missing model name in request.",
            ));
        }
        let request = GetModelMetadataRequest {
            model_spec: Some(model_spec(model, version, "")),
            metadata_field: vec!["signature_def".to_string()],
        };
        let response = self.api.metadata_checked(&request)?;
        let internal = |what: &str| ServingError::new(Code::Internal, what.to_string());
        let any = response.metadata.get("signature_def").ok_or_else(|| {
            internal(
                "Failed to find 'signature_def' key in the GetModelMetadataResponse metadata map.",
            )
        })?;
        let map = SignatureDefMap::decode(any.value.as_slice())
            .map_err(|_| internal("Failed to unpack 'Any' object to 'SignatureDefMap'."))?;
        let spec = response.model_spec.unwrap_or_default();
        let mut out = String::from("{\n\"model_spec\":{\n \"name\": ");
        write_string(&mut out, spec.name.as_bytes());
        out.push_str(",\n \"signature_name\": ");
        write_string(&mut out, spec.signature_name.as_bytes());
        if let Some(VersionChoice::Version(v)) = spec.version_choice {
            let _ = write!(out, ",\n \"version\": \"{v}\"");
        }
        out.push_str("\n}\n,\n\"metadata\": {\"signature_def\": ");
        write_signature_def_map(&mut out, &map);
        out.push_str("}\n}\n");
        Ok(out)
    }
}

/// A SignatureDefMap in protobuf's JSON form with proto field names and every field printed
/// (what TF Serving's metadata endpoint shows); map keys in name order.
fn write_signature_def_map(out: &mut String, map: &SignatureDefMap) {
    let mut keys: Vec<&String> = map.signature_def.keys().collect();
    keys.sort();
    out.push_str("{\n \"signature_def\": {");
    for (i, key) in keys.into_iter().enumerate() {
        let def = &map.signature_def[key];
        out.push_str(if i > 0 { ",\n  " } else { "\n  " });
        write_string(out, key.as_bytes());
        out.push_str(": {\n   \"inputs\": ");
        write_tensor_infos(out, &def.inputs);
        out.push_str(",\n   \"outputs\": ");
        write_tensor_infos(out, &def.outputs);
        out.push_str(",\n   \"method_name\": ");
        write_string(out, def.method_name.as_bytes());
        // Default values of inputs are TensorProtos; their JSON is not written (mpspool does
        // not apply them either), only the names they are for.
        out.push_str(",\n   \"defaults\": {");
        let mut names: Vec<&String> = def.defaults.keys().collect();
        names.sort();
        for (j, name) in names.into_iter().enumerate() {
            out.push_str(if j > 0 { ", " } else { "" });
            write_string(out, name.as_bytes());
            out.push_str(": {}");
        }
        out.push_str("}\n  }");
    }
    out.push_str("\n }\n}\n");
}

fn write_tensor_infos(out: &mut String, infos: &std::collections::HashMap<String, TensorInfo>) {
    use crate::proto::mpspool::tfs::tensor_info::Encoding;
    let mut names: Vec<&String> = infos.keys().collect();
    names.sort();
    out.push('{');
    for (i, name) in names.into_iter().enumerate() {
        let info = &infos[name];
        out.push_str(if i > 0 { ",\n    " } else { "\n    " });
        write_string(out, name.as_bytes());
        out.push_str(": {\n     \"dtype\": ");
        write_dtype(out, info.dtype);
        // A message field: printed only when set, as protobuf's JSON prints it (a TF1
        // TensorInfo of name and dtype alone read as a scalar's shape; found by a hunt).
        if let Some(shape) = &info.tensor_shape {
            out.push_str(",\n     \"tensor_shape\": ");
            write_shape(out, shape);
        }
        match &info.encoding {
            Some(Encoding::Name(tensor)) => {
                out.push_str(",\n     \"name\": ");
                write_string(out, tensor.as_bytes());
            }
            // A TF1 sparse placeholder's three tensors, as protobuf's JSON prints them.
            Some(Encoding::CooSparse(coo)) => {
                out.push_str(",\n     \"coo_sparse\": {\n      \"values_tensor_name\": ");
                write_string(out, coo.values_tensor_name.as_bytes());
                out.push_str(",\n      \"indices_tensor_name\": ");
                write_string(out, coo.indices_tensor_name.as_bytes());
                out.push_str(",\n      \"dense_shape_tensor_name\": ");
                write_string(out, coo.dense_shape_tensor_name.as_bytes());
                out.push_str("\n     }");
            }
            // Its type_spec is not kept (mpspool's proto leaves it out): no partial object.
            Some(Encoding::CompositeTensor(_)) | None => {}
        }
        out.push_str("\n    }");
    }
    out.push_str(if infos.is_empty() { "}" } else { "\n   }" });
}

/// TensorFlow's DataType enum (types.proto), by number: how protobuf's JSON, and so TF
/// Serving's metadata endpoint, names a dtype (`DT_INVALID` for the init op's NoOp output).
#[rustfmt::skip]
const DATA_TYPE_NAMES: [&str; 34] = [
    "DT_INVALID", "DT_FLOAT", "DT_DOUBLE", "DT_INT32", "DT_UINT8", "DT_INT16", "DT_INT8",
    "DT_STRING", "DT_COMPLEX64", "DT_INT64", "DT_BOOL", "DT_QINT8", "DT_QUINT8", "DT_QINT32",
    "DT_BFLOAT16", "DT_QINT16", "DT_QUINT16", "DT_UINT16", "DT_COMPLEX128", "DT_HALF",
    "DT_RESOURCE", "DT_VARIANT", "DT_UINT32", "DT_UINT64", "DT_FLOAT8_E5M2", "DT_FLOAT8_E4M3FN",
    "DT_FLOAT8_E4M3FNUZ", "DT_FLOAT8_E4M3B11FNUZ", "DT_FLOAT8_E5M2FNUZ", "DT_INT4", "DT_UINT4",
    "DT_INT2", "DT_UINT2", "DT_FLOAT4_E2M1FN",
];

/// The DataType enum's name (`DT_FLOAT`; a reference type, 100 more, `DT_FLOAT_REF`); a
/// number for one this table does not know, as protobuf's JSON prints an unknown enum value.
fn write_dtype(out: &mut String, dtype: i32) {
    let (base, suffix) = if dtype > 100 {
        (dtype - 100, "_REF")
    } else {
        (dtype, "")
    };
    match usize::try_from(base)
        .ok()
        .and_then(|i| DATA_TYPE_NAMES.get(i))
    {
        Some(name) => {
            let _ = write!(out, "\"{name}{suffix}\"");
        }
        _ => {
            let _ = write!(out, "{dtype}");
        }
    }
}

fn write_shape(out: &mut String, shape: &TensorShapeProto) {
    let (dims, unknown) = (&shape.dim[..], shape.unknown_rank);
    out.push_str("{\n      \"dim\": [");
    for (i, dim) in dims.iter().enumerate() {
        out.push_str(if i > 0 { ", " } else { "" });
        let _ = write!(out, "{{\"size\": \"{}\", \"name\": ", dim.size);
        write_string(out, dim.name.as_bytes());
        out.push('}');
    }
    let _ = write!(out, "],\n      \"unknown_rank\": {unknown}\n     }}");
}

/// Serves one HTTP/1.1 connection (keep-alive) until it closes or the drain ends it.
/// A body's data copied into one buffer as it arrives, each frame let go at once; None once
/// it passes `limit` bytes. http-body-util's `collect` kept every frame until the end, each
/// pinning the read buffer it was cut from: a body sent a byte per chunk (or per write) held
/// about 37 times its size, where the budget counts its bytes (found by a hunt).
async fn whole_body<B>(
    body: &mut B,
    limit: usize,
    declared: Option<u64>,
) -> Result<Option<Bytes>, B::Error>
where
    B: hyper::body::Body<Data = Bytes> + Unpin,
{
    // Grown by doubling from a first step (a length that is a lie takes no more than that
    // before its bytes come: the budget counts what comes), never past the declared length:
    // a body of 257 MiB took a 512 MiB buffer.
    let declared = declared.and_then(|n| usize::try_from(n).ok());
    let mut whole: Vec<u8> = Vec::new();
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame?.into_data() else {
            continue; // trailers: nothing of the document
        };
        if data.len() > limit.saturating_sub(whole.len()) {
            return Ok(None);
        }
        if whole.is_empty() && body.is_end_stream() {
            return Ok(Some(data)); // the whole body in one frame (the usual case): not copied
        }
        let needed = whole.len() + data.len();
        if needed > whole.capacity() {
            whole.reserve_exact(body_capacity(whole.capacity(), needed, declared) - whole.len());
        }
        whole.extend_from_slice(&data);
    }
    Ok(Some(Bytes::from(whole)))
}

/// The capacity a body's buffer grows to when `needed` bytes pass its `capacity`: double,
/// at least a first step (or the declared length, if less), never past the declared length.
fn body_capacity(capacity: usize, needed: usize, declared: Option<usize>) -> usize {
    let mut target = needed.max(capacity.saturating_mul(2));
    target = target.max(declared.unwrap_or(0).min(FIRST_BODY_BYTES));
    match declared {
        Some(declared) if needed <= declared => target.min(declared),
        _ => target,
    }
}

pub async fn serve_connection(
    stream: tokio::net::TcpStream,
    rest: Arc<Rest>,
    mut ending: tokio::sync::watch::Receiver<crate::server::Ending>,
    // The drain's count and the connection's place under --max-connections, until it ends.
    _held: (
        tokio::sync::mpsc::Sender<()>,
        crate::connection_limit::Admitted,
    ),
) {
    use crate::rest_conn::{Clocks, WatchedStream};
    use crate::server::Ending;
    // Its clocks (rest_conn.rs): idle between requests, a head's read from its first byte,
    // an answer's write; a head that stalls ends its connection unanswered, as hyper's own
    // header timeout did.
    let clocks = Clocks::new(rest.reading.stall);
    let watched = clocks.clone();
    let service = hyper::service::service_fn(move |request: Request<hyper::body::Incoming>| {
        let rest = rest.clone();
        let (head, body) = request.into_parts();
        let (handling, body) = watched.watch(body);
        let request = Request::from_parts(head, body);
        async move {
            let _handling = handling;
            let (response, held) = ANSWER_HELD
                .scope(RefCell::new(None), async {
                    let response = rest.handle(request).await;
                    (response, ANSWER_HELD.with(|held| held.borrow_mut().take()))
                })
                .await;
            let (head, body) = response.into_parts();
            // Full<Bytes> is ready at once: its one frame, or none.
            let bytes = match body.collect().await {
                Ok(collected) => collected.to_bytes(),
                Err(never) => match never {},
            };
            Ok::<_, std::convert::Infallible>(Response::from_parts(
                head,
                HeldAnswer::new(bytes, held),
            ))
        }
    });
    let mut builder = hyper::server::conn::http1::Builder::new();
    // half_close: a client that shuts its sending side once its request is out (`nc -N`,
    // socat, scripts piping a request) still gets its answer, as libevent's server gives it
    // (TF Serving stops reading a connection whose request is complete); hyper's default
    // would close the connection on that EOF, answer unsent. The cost, as there: a client
    // gone altogether mid-request is noticed when its answer is written, not before (its
    // request runs on, held to --rest_api_timeout_in_ms if set).
    builder
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(None) // the clocks' (its default would end heads after 30 s)
        .half_close(true);
    let io = hyper_util::rt::TokioIo::new(WatchedStream::new(stream, clocks.clone()));
    let connection = builder.serve_connection(io, service);
    tokio::pin!(connection);
    let mut going_away = false;
    loop {
        let look_again = match clocks.check(tokio::time::Instant::now()) {
            Ok(next) => next,
            Err(_) => return, // a clock ran out: the connection ends (its socket closed)
        };
        tokio::select! {
            _ = std::future::poll_fn(|cx| crate::rest_conn::turn(connection.as_mut(), &clocks, cx)) => return,
            changed = ending.changed() => {
                let now = if changed.is_err() { Ending::Now } else { *ending.borrow_and_update() };
                match now {
                    Ending::No => {}
                    Ending::Gracefully => if !going_away {
                        going_away = true;
                        connection.as_mut().graceful_shutdown();
                    },
                    Ending::Now => return,
                }
            }
            _ = sleep_until_if(look_again) => {}
        }
    }
}

/// Sleeps until `at`; for ever without one (no clock runs).
async fn sleep_until_if(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod whole_body_tests {
    use super::*;
    use hyper::body::Frame;
    use std::collections::VecDeque;
    use std::pin::Pin;
    use std::task::{Context, Poll};

    /// Frames handed out in order; is_end_stream true once they are all out.
    struct Frames(VecDeque<Frame<Bytes>>);

    impl hyper::body::Body for Frames {
        type Data = Bytes;
        type Error = std::convert::Infallible;
        fn poll_frame(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
            Poll::Ready(self.get_mut().0.pop_front().map(Ok))
        }
        fn is_end_stream(&self) -> bool {
            self.0.is_empty()
        }
    }

    fn frames(parts: &[&[u8]], trailers: bool) -> Frames {
        let mut out: VecDeque<_> = parts
            .iter()
            .map(|p| Frame::data(Bytes::copy_from_slice(p)))
            .collect();
        if trailers {
            out.push_back(Frame::trailers(hyper::HeaderMap::new()));
        }
        Frames(out)
    }

    fn run<F: std::future::Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(f)
    }

    #[test]
    fn a_body_is_limited_as_http_body_utils_limited_limited_it() {
        run(async {
            // Exactly the limit, in one frame and in several: taken.
            let got = whole_body(&mut frames(&[b"abcd"], false), 4, Some(4))
                .await
                .unwrap();
            assert_eq!(got.as_deref(), Some(&b"abcd"[..]));
            let got = whole_body(&mut frames(&[b"ab", b"", b"cd"], true), 4, None)
                .await
                .unwrap();
            assert_eq!(got.as_deref(), Some(&b"abcd"[..]));
            // One byte over: None, whichever frame passes it.
            assert!(whole_body(&mut frames(&[b"abcde"], false), 4, None)
                .await
                .unwrap()
                .is_none());
            assert!(whole_body(&mut frames(&[b"ab", b"cde"], false), 4, None)
                .await
                .unwrap()
                .is_none());
            // Empty bodies, trailers only, a limit of 0.
            assert_eq!(
                whole_body(&mut frames(&[], false), 4, None)
                    .await
                    .unwrap()
                    .as_deref(),
                Some(&b""[..])
            );
            assert_eq!(
                whole_body(&mut frames(&[], true), 0, None)
                    .await
                    .unwrap()
                    .as_deref(),
                Some(&b""[..])
            );
            assert_eq!(
                whole_body(&mut frames(&[b""], false), 0, Some(0))
                    .await
                    .unwrap()
                    .as_deref(),
                Some(&b""[..])
            );
            // Data after an empty first frame with the end at once.
            let got = whole_body(&mut frames(&[b"", b"xy"], false), 4, Some(2))
                .await
                .unwrap();
            assert_eq!(got.as_deref(), Some(&b"xy"[..]));
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_body_buffer_grows_by_doubling_and_never_past_its_declared_length() {
        let mib = 1 << 20;
        // A declared 3 MiB + 1: 1 MiB first, then 2, then exactly the declared length (it
        // took 4 MiB, and a 257 MiB body 512).
        let declared = Some(3 * mib + 1);
        assert_eq!(body_capacity(0, 64 << 10, declared), mib);
        assert_eq!(body_capacity(mib, mib + 1, declared), 2 * mib);
        assert_eq!(body_capacity(2 * mib, 2 * mib + 1, declared), 3 * mib + 1);
        // A small declared length is taken at once; no length: doubling from what came.
        assert_eq!(body_capacity(0, 10, Some(5000)), 5000);
        assert_eq!(body_capacity(0, 10, None), 10);
        assert_eq!(body_capacity(10, 11, None), 20);
        // More than declared (a chunked body has none; a lie is refused by hyper): doubling.
        assert_eq!(body_capacity(100, 101, Some(100)), 200);
    }

    fn gzip(members: &[&[u8]]) -> Bytes {
        use std::io::Write as _;
        let mut out = Vec::new();
        for member in members {
            let mut encoder =
                flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
            encoder.write_all(member).unwrap();
            out.extend(encoder.finish().unwrap());
        }
        Bytes::from(out)
    }

    #[test]
    fn a_gzipped_body_is_read_uncompressed_and_holds_its_share_of_the_budget() {
        let mut headers = hyper::HeaderMap::new();
        assert!(!gzipped(&headers));
        for (value, is) in [
            ("gzip", true),
            ("x-gzip", true),
            ("GZip", true),
            ("br", false),
        ] {
            headers.insert(hyper::header::CONTENT_ENCODING, value.parse().unwrap());
            assert_eq!(gzipped(&headers), is, "{value}");
        }

        let budget = RequestBudget::new(request_budget::BUDGET_MIN);
        let document = format!("{{\"instances\": [{}1]}}", "1, ".repeat(100_000));
        let half = document.len() / 2;
        // Two members, as `cat a.gz b.gz` makes: both are the body, as zlib's reading has it.
        let body = gzip(&[&document.as_bytes()[..half], &document.as_bytes()[half..]]);
        assert!(body.len() * 20 < document.len());
        let read = gunzip(body.into(), 1 << 20, &budget).unwrap();
        assert_eq!(read.bytes, document.as_bytes());
        let held = request_budget::share_bytes(read.held.as_ref());
        assert!(
            held >= document.len() && held < document.len() + 1024,
            "{held}"
        );
        assert_eq!(budget.held_bytes(), held);
        drop(read);
        assert_eq!(budget.held_bytes(), 0);

        // Uncompressed, over the body limit: 413, whatever its compressed size.
        let bomb = gzip(&[&vec![b' '; 8 << 20]]);
        assert!(bomb.len() < 64 << 10);
        assert!(matches!(
            gunzip(bomb.clone().into(), 1 << 20, &budget),
            Err(Gunzip::TooLarge)
        ));
        // Over what the budget has free: 429, and nothing kept.
        let full = RequestBudget::new(request_budget::BUDGET_MIN);
        let _others = full
            .try_reserve(request_budget::BUDGET_MIN - (1 << 20))
            .unwrap();
        let Err(Gunzip::Refused(refused)) = gunzip(bomb.into(), 64 << 20, &full) else {
            panic!("not refused");
        };
        assert_eq!(refused.code, Code::ResourceExhausted);
        assert_eq!(full.held_bytes(), request_budget::BUDGET_MIN - (1 << 20));
        // Not gzip at all.
        let Err(Gunzip::Refused(bad)) = gunzip(Bytes::from_static(b"{}").into(), 1 << 20, &budget)
        else {
            panic!("not refused");
        };
        assert_eq!(bad.code, Code::InvalidArgument);
        assert!(
            bad.message
                .starts_with("Failed to uncompress the gzipped body: "),
            "{}",
            bad.message
        );
        assert_eq!(budget.held_bytes(), 0);
    }

    /// Large work leaves the runtime's thread free: on a runtime of one thread (a front door
    /// on a busy host has one), the work waits for a task that needs that thread, which runs
    /// only because the work is elsewhere. Small work runs in place, with no hand-off.
    #[tokio::test(flavor = "current_thread")]
    async fn large_work_runs_where_the_serving_thread_stays_free() {
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let other_request = tokio::spawn(async move { tx.send(()) });
        let served = on_a_blocking_thread_if(true, "writing the answer", move || {
            rx.recv_timeout(Duration::from_secs(10))
                .map_err(|_| ServingError::new(Code::Internal, "the serving thread was held"))
        })
        .await;
        assert_eq!(served, Ok(()));
        assert!(other_request.await.unwrap().is_ok());

        let caller = std::thread::current().id();
        let small = on_a_blocking_thread_if(false, "writing the answer", move || {
            Ok(std::thread::current().id())
        });
        assert_eq!(small.await, Ok(caller));
        let panicked = on_a_blocking_thread_if(true, "writing the answer", || -> Result<(), _> {
            panic!("a bug")
        });
        let error = panicked.await.unwrap_err();
        assert_eq!(error.code, Code::Internal);
        assert!(error.message.starts_with("writing the answer failed: "));
    }

    #[tokio::test]
    async fn work_on_a_body_holds_its_share_of_the_budget_and_keeps_what_it_built() {
        let budget = Arc::new(RequestBudget::new(request_budget::BUDGET_MIN));
        // In place, then on a blocking thread.
        for size in [1000, BLOCKING_BODY_BYTES + 1] {
            let body = Bytes::from(vec![b' '; size]);
            let seen = budget.clone();
            let built = 3 << 10;
            let (during, kept) = parse_within(&budget, body.into(), None, move |_| {
                Ok((seen.held_bytes(), built))
            })
            .await
            .unwrap();
            assert!(during >= size, "{size}: held while working");
            assert_eq!(
                budget.held_bytes(),
                built,
                "{size}: the built form's share kept"
            );
            drop(kept);
            assert_eq!(budget.held_bytes(), 0, "{size}: given back with the answer");
        }
        // In place, but its most (641 times its size: 64 MiB) over 1/16 of the budget: its cost
        // as read, which leaves gRPC requests the rest meanwhile.
        let body = Bytes::from(vec![b' '; 100 << 10]);
        let seen = budget.clone();
        let (during, _) = parse_within(&budget, body.into(), None, move |_| {
            Ok((seen.held_bytes(), 0))
        })
        .await
        .unwrap();
        assert!(
            during < 1 << 20,
            "{during} bytes held for 100 KiB of spaces"
        );
        // A body whose work fails keeps nothing.
        let body = Bytes::from(vec![b' '; 1000]);
        let failed = parse_within(&budget, body.into(), None, |_| {
            Err::<((), usize), _>(ServingError::invalid_argument("no"))
        })
        .await;
        assert!(failed.is_err());
        assert_eq!(budget.held_bytes(), 0);
    }

    #[tokio::test]
    async fn a_body_keeps_its_bytes_share_while_parsed_in_place_and_gives_it_back_to_wait() {
        let budget = Arc::new(RequestBudget::new(request_budget::BUDGET_MIN));
        let body = |held| ReadBody {
            bytes: Bytes::from(vec![b' '; 1000]),
            held,
        };
        // In place: its bytes' share (100 KiB here) beside its document's.
        let read = budget.try_reserve(100 << 10);
        let seen = budget.clone();
        let (during, kept) = parse_within(&budget, body(read), None, move |_| {
            Ok((seen.held_bytes(), 0))
        })
        .await
        .unwrap();
        assert!(during > 100 << 10, "{during}");
        drop(kept);
        assert_eq!(budget.held_bytes(), 0);
        // Its own share is what keeps the budget from having room: it gives it back and gets
        // the room (it would wait for ever for the room it holds itself).
        let free = 64 << 10;
        let others = budget.try_reserve(request_budget::BUDGET_MIN - free);
        let read = budget.try_reserve(free);
        let parsed = tokio::time::timeout(
            Duration::from_secs(10),
            parse_within(&budget, body(read), None, |_| Ok(((), 0))),
        )
        .await;
        let Ok(Ok(((), kept))) = parsed else {
            panic!("waited for its own share");
        };
        drop((kept, others));
        assert_eq!(budget.held_bytes(), 0);
    }

    fn post(path: &str) -> Option<Route> {
        route(&HttpMethod::POST, path).unwrap()
    }

    fn get(path: &str) -> Option<Route> {
        route(&HttpMethod::GET, path).unwrap()
    }

    #[test]
    fn paths_route_as_tf_servings_patterns() {
        let call = |model: &str, version: Version, method: &str| {
            Some(Route::Call {
                model: model.into(),
                version,
                method: method.into(),
            })
        };
        assert_eq!(
            post("/v1/models/demo:predict"),
            call("demo", Version::Latest, "predict")
        );
        assert_eq!(
            post("/v1/models/demo/versions/3:classify"),
            call("demo", Version::Number(3), "classify")
        );
        assert_eq!(
            post("/V1/Models/de%20mo/labels/stable:regress"),
            call("de mo", Version::Label("stable".into()), "regress")
        );
        assert_eq!(post("/v1/models/demo/versions/x:predict"), None);
        assert_eq!(post("/v1/models/demo:explain"), None);
        // The path comes with its query, as TF Serving's handler reads it: a query after the
        // method matches nothing, one before it is part of the name ([^/:]+).
        assert_eq!(post("/v1/models/demo:predict?verbose=1"), None);
        assert_eq!(get("/v1/models/demo/versions/1?x=1"), None);
        assert_eq!(
            post("/v1/models/demo?x=a:predict"),
            call("demo?x=a", Version::Latest, "predict")
        );
        assert_eq!(post("/v1/models/demo"), None);
        assert_eq!(post("/v1/models/:predict"), None);
        assert_eq!(
            get("/v1/models/demo"),
            Some(Route::Status {
                model: "demo".into(),
                version: Version::Latest
            })
        );
        assert_eq!(
            get("/v1/models/demo/labels/canary/metadata"),
            Some(Route::Metadata {
                model: "demo".into(),
                version: Version::Label("canary".into())
            })
        );
        assert_eq!(
            get("/v1/models/demo/versions/7"),
            Some(Route::Status {
                model: "demo".into(),
                version: Version::Number(7)
            })
        );
        assert_eq!(
            get("/v1/models"),
            Some(Route::Status {
                model: String::new(),
                version: Version::Latest
            })
        );
        // The version part comes first: a label may be named "metadata" (found by a REST
        // hunt: this was a 400), and `/METADATA` matches the pattern but asks for a status.
        let status = |version: Version| {
            Some(Route::Status {
                model: "demo".into(),
                version,
            })
        };
        assert_eq!(
            get("/v1/models/demo/labels/metadata"),
            status(Version::Label("metadata".into()))
        );
        assert_eq!(
            get("/v1/models/demo/labels/metadata/metadata"),
            Some(Route::Metadata {
                model: "demo".into(),
                version: Version::Label("metadata".into())
            })
        );
        assert_eq!(get("/v1/models/demo/METADATA"), status(Version::Latest));
        assert_eq!(
            get("/v1/models/demo/versions/2/Metadata"),
            status(Version::Number(2))
        );
        assert_eq!(
            get("/v1/models/demo/metadata"),
            Some(Route::Metadata {
                model: "demo".into(),
                version: Version::Latest
            })
        );
        assert_eq!(get("/v1/models/metadata"), {
            Some(Route::Status {
                model: "metadata".into(),
                version: Version::Latest,
            })
        });
        assert_eq!(get("/v1/models/demo/versions/metadata"), None);
        assert_eq!(get("/v1/models/demo/other"), None);
        assert_eq!(get("/metrics"), None);
        let huge = route(
            &HttpMethod::GET,
            "/v1/models/demo/versions/99999999999999999999",
        );
        assert_eq!(
            huge.unwrap_err().message,
            "Failed to convert version: 99999999999999999999 to numeric."
        );
    }

    #[test]
    fn methods_outside_libevents_allowed_set_are_not_taken() {
        for method in ["GET", "POST", "HEAD", "PUT", "DELETE", "OPTIONS", "PATCH"] {
            assert!(libevent_takes(&method.parse().unwrap()), "{method}");
        }
        for method in ["TRACE", "CONNECT", "PROPFIND", "FOO", "get"] {
            assert!(!libevent_takes(&method.parse().unwrap()), "{method}");
        }
    }

    #[test]
    fn codes_map_to_tf_servings_http_statuses() {
        assert_eq!(http_status(Code::InvalidArgument), StatusCode::BAD_REQUEST);
        assert_eq!(
            http_status(Code::FailedPrecondition),
            StatusCode::BAD_REQUEST
        );
        assert_eq!(http_status(Code::NotFound), StatusCode::NOT_FOUND);
        assert_eq!(
            http_status(Code::Unavailable),
            StatusCode::SERVICE_UNAVAILABLE
        );
        assert_eq!(
            http_status(Code::DeadlineExceeded),
            StatusCode::GATEWAY_TIMEOUT
        );
        assert_eq!(
            http_status(Code::ResourceExhausted),
            StatusCode::TOO_MANY_REQUESTS
        );
        assert_eq!(
            http_status(Code::Unimplemented),
            StatusCode::NOT_IMPLEMENTED
        );
        assert_eq!(http_status(Code::Cancelled).as_u16(), 499);
    }

    #[test]
    fn a_preflight_is_answered_when_its_origin_names_an_http_origin() {
        let status = |origin: Option<&str>| {
            let mut headers = hyper::HeaderMap::new();
            if let Some(origin) = origin {
                headers.insert(hyper::header::ORIGIN, origin.parse().unwrap());
            }
            let response = preflight(&headers);
            assert!(response.headers().is_empty());
            response.status().as_u16()
        };
        assert_eq!(status(Some("https://app.example.com")), 200);
        assert_eq!(status(Some("http://localhost:3000")), 200);
        assert_eq!(status(Some("null")), 400);
        assert_eq!(status(None), 400);
        let mut headers = hyper::HeaderMap::new();
        add_cors_headers(&mut headers);
        assert_eq!(headers["access-control-allow-origin"], "*");
        assert_eq!(headers["access-control-allow-methods"], "POST, GET");
        assert_eq!(headers["access-control-allow-headers"], "Content-Type");
    }

    #[test]
    fn dtypes_are_written_by_their_enum_names_as_protobuf_json_writes_them() {
        let written = |dtype| {
            let mut out = String::new();
            write_dtype(&mut out, dtype);
            out
        };
        assert_eq!(written(0), "\"DT_INVALID\"", "the init op's NoOp output");
        assert_eq!(written(9), "\"DT_INT64\"");
        assert_eq!(written(20), "\"DT_RESOURCE\"");
        assert_eq!(written(33), "\"DT_FLOAT4_E2M1FN\"");
        assert_eq!(written(101), "\"DT_FLOAT_REF\"");
        // Numbers the enum does not have are printed as numbers.
        for unknown in [34, 99, 100, 134, -1] {
            assert_eq!(written(unknown), unknown.to_string());
        }
    }

    #[test]
    fn an_answers_json_arrays_are_counted_from_its_shape() {
        let shaped = |dims: &[i64]| crate::codec::output_shell(crate::codec::DT_FLOAT, dims);
        assert_eq!(json_arrays(&shaped(&[])), 0);
        assert_eq!(json_arrays(&shaped(&[5])), 1);
        assert_eq!(json_arrays(&shaped(&[2, 3, 4])), 1 + 2 + 6);
        // Empty, and all brackets: [[[], ...], ...].
        assert_eq!(json_arrays(&shaped(&[100_000_000, 1, 0])), 200_000_001);
        assert_eq!(json_arrays(&shaped(&[1 << 62, 1 << 62, 0])), u64::MAX);
    }

    #[test]
    fn signature_maps_are_written_as_protobuf_json() {
        use crate::proto::mpspool::tfs::{
            tensor_info, tensor_info::Encoding, tensor_shape_proto::Dim, SignatureDef,
        };
        let info = TensorInfo {
            encoding: Some(Encoding::Name("serving_default_ids:0".into())),
            dtype: crate::codec::DT_INT64,
            tensor_shape: Some(TensorShapeProto {
                dim: vec![Dim {
                    size: -1,
                    name: String::new(),
                }],
                unknown_rank: false,
            }),
        };
        let sparse = TensorInfo {
            encoding: Some(Encoding::CooSparse(tensor_info::CooSparse {
                values_tensor_name: "sp/values:0".into(),
                indices_tensor_name: "sp/indices:0".into(),
                dense_shape_tensor_name: "sp/shape:0".into(),
            })),
            dtype: 1,
            tensor_shape: None,
        };
        let def = SignatureDef {
            inputs: [("ids".to_string(), info), ("sp".to_string(), sparse)].into(),
            outputs: Default::default(),
            method_name: "tensorflow/serving/predict".into(),
            defaults: Default::default(),
        };
        let map = SignatureDefMap {
            signature_def: [("serving_default".to_string(), def)].into(),
        };
        let mut out = String::new();
        write_signature_def_map(&mut out, &map);
        let value: serde_json::Value = serde_json::from_str(&out).unwrap();
        let expected = serde_json::json!({"signature_def": {"serving_default": {
            "inputs": {"ids": {"dtype": "DT_INT64", "name": "serving_default_ids:0",
                "tensor_shape": {"dim": [{"size": "-1", "name": ""}], "unknown_rank": false}},
                // No shape given: none printed (it read as a scalar's).
                "sp": {"dtype": "DT_FLOAT",
                "coo_sparse": {"values_tensor_name": "sp/values:0",
                    "indices_tensor_name": "sp/indices:0",
                    "dense_shape_tensor_name": "sp/shape:0"}}},
            "outputs": {}, "method_name": "tensorflow/serving/predict", "defaults": {}}}});
        assert_eq!(value, expected);
    }
}
