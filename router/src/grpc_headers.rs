//! The request headers a gRPC server refuses before any method runs, as gRPC's C core (TF
//! Serving's gRPC server) refuses them in its HttpServerFilter: a `:method` other than POST,
//! and a `te` other than `trailers`, each answered UNKNOWN with the C core's words. tonic
//! routes by path alone: a GET (a browser, `curl --http2-prior-knowledge` without `-X POST`)
//! ran a Predict. The content type is not checked, as the C core does not check it.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use pin_project_lite::pin_project;

/// Why the C core would refuse a call with this method and these headers (None: it takes
/// it). Its checks, in its order; `:scheme` and `:path` are HTTP/2's own (h2 refuses a
/// request without them).
pub fn refusal(method: &http::Method, headers: &http::HeaderMap) -> Option<&'static str> {
    if method != http::Method::POST {
        return Some("Bad method header");
    }
    match headers.get(http::header::TE) {
        None => Some("Missing :te header"),
        Some(te) if te.as_bytes() != b"trailers" => Some("Bad :te header"),
        Some(_) => None,
    }
}

/// `S` behind the C core's header checks: a call they refuse is answered UNKNOWN at once,
/// with no message read, and never reaches `S`.
#[derive(Clone)]
pub struct WellFormed<S>(pub S);

impl<S, B> tower::Service<http::Request<B>> for WellFormed<S>
where
    S: tower::Service<
        http::Request<B>,
        Response = http::Response<tonic::body::Body>,
        Error = Infallible,
    >,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = Checked<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        match refusal(request.method(), request.headers()) {
            Some(why) => Checked::Refused {
                answer: Some(tonic::Status::unknown(why).into_http()),
            },
            None => Checked::Taken {
                call: self.0.call(request),
            },
        }
    }
}

pin_project! {
    /// A call's answer: the refusal, or what the service answers.
    #[project = CheckedProjection]
    pub enum Checked<F> {
        Refused { answer: Option<http::Response<tonic::body::Body>> },
        Taken { #[pin] call: F },
    }
}

impl<F> Future for Checked<F>
where
    F: Future<Output = Result<http::Response<tonic::body::Body>, Infallible>>,
{
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project() {
            // Polled again after Ready (never, by contract): an empty answer, not a panic.
            CheckedProjection::Refused { answer } => {
                Poll::Ready(Ok(answer.take().unwrap_or_default()))
            }
            CheckedProjection::Taken { call } => call.poll(cx),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tower::ServiceExt;

    fn headers(te: Option<&str>) -> http::HeaderMap {
        let mut headers = http::HeaderMap::new();
        if let Some(te) = te {
            headers.insert(http::header::TE, te.parse().unwrap());
        }
        headers
    }

    #[test]
    fn the_c_cores_checks_in_its_words() {
        let post = http::Method::POST;
        assert_eq!(refusal(&post, &headers(Some("trailers"))), None);
        assert_eq!(
            refusal(&http::Method::GET, &headers(Some("trailers"))),
            Some("Bad method header")
        );
        assert_eq!(
            refusal(&http::Method::PUT, &headers(Some("trailers"))),
            Some("Bad method header")
        );
        assert_eq!(refusal(&post, &headers(None)), Some("Missing :te header"));
        assert_eq!(
            refusal(&post, &headers(Some("gzip"))),
            Some("Bad :te header")
        );
        assert_eq!(
            refusal(&post, &headers(Some("Trailers"))),
            Some("Bad :te header")
        );
    }

    #[tokio::test]
    async fn a_refused_call_never_reaches_the_service() {
        let reached = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = reached.clone();
        let service = WellFormed(tower::service_fn(move |_: http::Request<()>| {
            counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            async { Ok::<_, Infallible>(http::Response::new(tonic::body::Body::empty())) }
        }));
        let request = |method: http::Method| {
            let mut request = http::Request::new(());
            *request.method_mut() = method;
            request
                .headers_mut()
                .insert(http::header::TE, "trailers".parse().unwrap());
            request
        };
        let refused = service
            .clone()
            .oneshot(request(http::Method::GET))
            .await
            .unwrap();
        assert_eq!(refused.headers()["grpc-status"], "2");
        // tonic percent-encodes the message; clients decode it.
        assert_eq!(refused.headers()["grpc-message"], "Bad%20method%20header");
        assert_eq!(reached.load(std::sync::atomic::Ordering::SeqCst), 0);
        let taken = service.oneshot(request(http::Method::POST)).await.unwrap();
        assert!(!taken.headers().contains_key("grpc-status"));
        assert_eq!(reached.load(std::sync::atomic::Ordering::SeqCst), 1);
    }
}
