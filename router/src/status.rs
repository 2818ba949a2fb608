//! The one error a request can fail with: a gRPC status code and TF Serving's message.
//!
//! Codes are gRPC's (TensorFlow's `error::Code` uses the same numbers), so a worker's error
//! crosses ZeroMQ as an integer and reaches the client unchanged. Mapped to `tonic::Status` in
//! exactly one place (`From<ServingError> for tonic::Status`).

/// gRPC status codes, numbered as on the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(i32)]
pub enum Code {
    Ok = 0,
    Cancelled = 1,
    Unknown = 2,
    InvalidArgument = 3,
    DeadlineExceeded = 4,
    NotFound = 5,
    AlreadyExists = 6,
    PermissionDenied = 7,
    ResourceExhausted = 8,
    FailedPrecondition = 9,
    Aborted = 10,
    OutOfRange = 11,
    Unimplemented = 12,
    Internal = 13,
    Unavailable = 14,
    DataLoss = 15,
    Unauthenticated = 16,
}

impl Code {
    /// The code for a number a worker sent; numbers outside gRPC's range are UNKNOWN.
    pub fn from_i32(value: i32) -> Code {
        match value {
            0 => Code::Ok,
            1 => Code::Cancelled,
            3 => Code::InvalidArgument,
            4 => Code::DeadlineExceeded,
            5 => Code::NotFound,
            6 => Code::AlreadyExists,
            7 => Code::PermissionDenied,
            8 => Code::ResourceExhausted,
            9 => Code::FailedPrecondition,
            10 => Code::Aborted,
            11 => Code::OutOfRange,
            12 => Code::Unimplemented,
            13 => Code::Internal,
            14 => Code::Unavailable,
            15 => Code::DataLoss,
            16 => Code::Unauthenticated,
            _ => Code::Unknown,
        }
    }

    /// The code of an error a worker sent: as `from_i32`, but OK is no error's code, and
    /// an error said with it is UNKNOWN (a status of OK carries no answer: gRPC would end
    /// the call OK without one, REST answer 200 with an error).
    pub fn of_error(value: i32) -> Code {
        match Code::from_i32(value) {
            Code::Ok => Code::Unknown,
            code => code,
        }
    }

    /// The upper-case name Prometheus labels and logs use (`INVALID_ARGUMENT`).
    pub fn name(self) -> &'static str {
        match self {
            Code::Ok => "OK",
            Code::Cancelled => "CANCELLED",
            Code::Unknown => "UNKNOWN",
            Code::InvalidArgument => "INVALID_ARGUMENT",
            Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
            Code::NotFound => "NOT_FOUND",
            Code::AlreadyExists => "ALREADY_EXISTS",
            Code::PermissionDenied => "PERMISSION_DENIED",
            Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
            Code::FailedPrecondition => "FAILED_PRECONDITION",
            Code::Aborted => "ABORTED",
            Code::OutOfRange => "OUT_OF_RANGE",
            Code::Unimplemented => "UNIMPLEMENTED",
            Code::Internal => "INTERNAL",
            Code::Unavailable => "UNAVAILABLE",
            Code::DataLoss => "DATA_LOSS",
            Code::Unauthenticated => "UNAUTHENTICATED",
        }
    }
}

/// A failure's reason as the controller words it, in absl::Status::ToString's form
/// (`mpspool/errors.py`, `status_text`): "NOT_FOUND: message" is NOT_FOUND and the message; a
/// reason that does not begin with a code's name is UNKNOWN, all of it the message.
pub fn split_status_text(text: &str) -> (Code, &str) {
    text.split_once(": ")
        .and_then(|(name, message)| {
            (1..=16)
                .map(Code::from_i32)
                .find(|code| code.name() == name)
                .map(|code| (code, message))
        })
        .unwrap_or((Code::Unknown, text))
}

/// A request failed with a TF Serving status code and message.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{}: {message}", code.name())]
pub struct ServingError {
    pub code: Code,
    pub message: String,
}

impl ServingError {
    pub fn new(code: Code, message: impl Into<String>) -> ServingError {
        ServingError {
            code,
            message: message.into(),
        }
    }

    pub fn invalid_argument(message: impl Into<String>) -> ServingError {
        ServingError::new(Code::InvalidArgument, message)
    }
}

/// The most bytes a status message may take on the wire, as gRPC's `grpc-message` trailer.
/// Messages echo what the client sent (a model name, a signature, the inputs it named); past
/// 8 KiB of trailers gRPC C++ clients may drop the status, past 16 KiB they do, and the caller
/// sees RESOURCE_EXHAUSTED "received metadata size exceeds limit" instead of its error. The
/// limit is on the percent-encoded form: tonic writes a non-ASCII byte, a control byte, a space
/// and `"#%<>`?{}` as three bytes each, so 4 KiB of text can take 12 on the wire.
const MAX_STATUS_MESSAGE_BYTES: usize = 4096;

/// Bytes `byte` takes in the `grpc-message` trailer: tonic's percent-encoding set
/// (CONTROLS plus ` "#%<>`?{}`; every non-ASCII byte is encoded too).
fn encoded_len(byte: u8) -> usize {
    match byte {
        0x00..=0x1f
        | 0x7f..=0xff
        | b' '
        | b'"'
        | b'#'
        | b'%'
        | b'<'
        | b'>'
        | b'`'
        | b'?'
        | b'{'
        | b'}' => 3,
        _ => 1,
    }
}

/// `message`, whole if its encoded form fits MAX_STATUS_MESSAGE_BYTES; else cut at a character
/// boundary so that the kept part and the note saying how much was cut fit together.
fn status_message(mut message: String) -> String {
    let encoded: usize = message.bytes().map(encoded_len).sum();
    if encoded <= MAX_STATUS_MESSAGE_BYTES {
        return message;
    }
    // The note is ASCII with one space before "(", two inside: at most 64 bytes encoded.
    let room = MAX_STATUS_MESSAGE_BYTES - 64;
    let (mut keep, mut used) = (0, 0);
    for (at, character) in message.char_indices() {
        let cost: usize = message[at..at + character.len_utf8()]
            .bytes()
            .map(encoded_len)
            .sum();
        if used + cost > room {
            break;
        }
        used += cost;
        keep = at + character.len_utf8();
    }
    let total = message.len();
    message.truncate(keep);
    message.push_str(&format!("... ({} more bytes)", total - keep));
    message
}

impl From<ServingError> for tonic::Status {
    fn from(error: ServingError) -> tonic::Status {
        let message = status_message(error.message);
        tonic::Status::new(tonic::Code::from_i32(error.code as i32), message)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_through_their_numbers() {
        for n in 0..=16 {
            assert_eq!(Code::from_i32(n) as i32, n);
        }
        assert_eq!(Code::from_i32(99), Code::Unknown);
        assert_eq!(Code::from_i32(-1), Code::Unknown);
        assert_eq!(Code::of_error(0), Code::Unknown);
        assert_eq!(Code::of_error(5), Code::NotFound);
    }

    #[test]
    fn a_reason_gives_the_code_it_begins_with() {
        assert_eq!(
            split_status_text("NOT_FOUND: cannot load model m: no saved_model.pb"),
            (Code::NotFound, "cannot load model m: no saved_model.pb")
        );
        assert_eq!(
            split_status_text("DATA_LOSS: checksum: does not match"),
            (Code::DataLoss, "checksum: does not match")
        );
        // No code name first (lower case, an unknown word, OK, none at all): UNKNOWN, whole.
        for text in [
            "cannot load: no variables",
            "not_found: x",
            "NOTFOUND: x",
            "OK: x",
            "",
        ] {
            assert_eq!(split_status_text(text), (Code::Unknown, text));
        }
    }

    #[test]
    fn maps_to_the_same_grpc_status() {
        let status: tonic::Status = ServingError::new(Code::NotFound, "gone").into();
        assert_eq!(status.code(), tonic::Code::NotFound);
        assert_eq!(status.message(), "gone");
    }

    /// The message as tonic writes it into the trailer.
    fn on_the_wire(status: &tonic::Status) -> usize {
        status.message().bytes().map(encoded_len).sum()
    }

    #[test]
    fn a_long_message_is_cut_at_a_character_and_says_how_much() {
        let name = "é".repeat(10_000); // 2 bytes each: a cut may not split one
        let status: tonic::Status =
            ServingError::new(Code::NotFound, format!("Servable {name} not found")).into();
        assert!(on_the_wire(&status) <= MAX_STATUS_MESSAGE_BYTES);
        assert!(status.message().starts_with("Servable éé"));
        let total = 20_000 + "Servable  not found".len();
        let (kept, said) = status
            .message()
            .split_once("... (")
            .expect("the cut is said");
        assert_eq!(said, format!("{} more bytes)", total - kept.len()));
        let short: tonic::Status = ServingError::new(Code::NotFound, "x".repeat(4096)).into();
        assert_eq!(short.message().len(), 4096, "at the limit: whole");
    }

    #[test]
    fn the_limit_is_on_the_encoded_message() {
        // 3,000 bytes of text but 9,000 on the wire: every byte is percent-encoded.
        let status: tonic::Status =
            ServingError::new(Code::InvalidArgument, "{ ?".repeat(1_000)).into();
        assert!(status.message().contains("more bytes)"), "cut");
        let wire = on_the_wire(&status);
        assert!(
            (MAX_STATUS_MESSAGE_BYTES - 64..=MAX_STATUS_MESSAGE_BYTES).contains(&wire),
            "{wire}"
        );
        // What tonic really writes: percent_encoding's own count agrees with ours.
        let mut headers = http::HeaderMap::new();
        status.add_header(&mut headers).expect("a valid trailer");
        assert_eq!(headers["grpc-message"].len(), wire);
    }
}
