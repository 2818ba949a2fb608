//! Serving signatures as plain data, and the checks a request must pass against one: the Rust
//! side of `mpspool/signature.py` (the worker checks again with that module, so nothing
//! malformed reaches TensorFlow). Messages follow TF Serving's, byte for byte.

use std::borrow::Cow;
use std::collections::{BTreeSet, HashMap};

use bytes::Bytes;
use prost::Message;

use crate::codec::dtype_name;
use crate::proto::mpspool::tfs::{SignatureDefMap, TensorInfo};
use crate::status::{Code, ServingError};

pub const DEFAULT_SIGNATURE: &str = "serving_default";

#[derive(Clone, Debug, PartialEq)]
pub struct TensorSpec {
    pub dtype: i32,
    /// None: unknown rank; -1: unknown dimension.
    pub shape: Option<Vec<i64>>,
}

impl TensorSpec {
    fn shape_text(&self) -> String {
        match &self.shape {
            None => "<unknown>".to_string(),
            Some(shape) => shape_text(shape),
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct SignatureSpec {
    pub key: String,
    pub method_name: String,
    pub inputs: HashMap<String, TensorSpec>,
    pub outputs: HashMap<String, TensorSpec>,
    /// Output aliases in name order: what an empty output_filter asks for.
    pub output_names: Vec<String>,
}

impl SignatureSpec {
    /// Whether every input, and each of `outputs`, is declared with a first dimension of
    /// any size (a row per request row, as a batched model's tensors are), or with no shape
    /// at all (nothing to go by). A scalar, or a tensor whose first dimension has a fixed
    /// size, is not cut by rows: a request of such a signature neither shares a call nor is
    /// split. An output of fixed size (a vocabulary, a model's constants) would be another
    /// call's rows or repeated per chunk; an input of fixed size (a table of 4 weights beside
    /// 4 rows, a SparseTensor's dense shape) was cut or stacked with the rows whenever its
    /// size happened to equal their count, and the model answered wrongly without an error
    /// (found by a hunt).
    pub fn answers_row_by_row(&self, outputs: &[String]) -> bool {
        let by_rows = |spec: &TensorSpec| {
            spec.shape
                .as_deref()
                .is_none_or(|shape| shape.first() == Some(&-1))
        };
        self.inputs.values().all(by_rows)
            && outputs
                .iter()
                .all(|name| self.outputs.get(name).is_none_or(by_rows))
    }
}

/// The served model's signatures, as its first READY worker sent them.
#[derive(Clone, Debug)]
pub struct ModelSignatures {
    /// The serialized SignatureDefMap, served back in GetModelMetadata.
    pub signature_defs: Bytes,
    pub specs: HashMap<String, SignatureSpec>,
    /// The map lists the init op's entry (tf.saved_model.save writes one): not in `specs`,
    /// but TF Serving's REST API finds it (`rest_inputs`).
    pub init_op_listed: bool,
}

/// The entry tf.saved_model.save writes for the model's initializer: a signature_def, but no
/// function to call (`mpspool/signature.py` INIT_OP_KEY).
pub const INIT_OP_KEY: &str = "__saved_model_init_op";

/// Specs for every signature a request can call: all but the init op's entry. One that takes
/// no inputs (a vocabulary, a constant) is called with none, as TF Serving does.
pub fn parse(signature_defs: Bytes) -> Result<ModelSignatures, prost::DecodeError> {
    let map = SignatureDefMap::decode(signature_defs.clone())?;
    let mut specs = HashMap::new();
    let mut init_op_listed = false;
    for (key, sig) in map.signature_def {
        if key == INIT_OP_KEY {
            init_op_listed = true;
            continue;
        }
        let mut output_names: Vec<String> = sig.outputs.keys().cloned().collect();
        output_names.sort();
        specs.insert(
            key.clone(),
            SignatureSpec {
                key,
                method_name: sig.method_name,
                inputs: sig
                    .inputs
                    .iter()
                    .map(|(k, v)| (k.clone(), tensor_spec(v)))
                    .collect(),
                outputs: sig
                    .outputs
                    .iter()
                    .map(|(k, v)| (k.clone(), tensor_spec(v)))
                    .collect(),
                output_names,
            },
        );
    }
    Ok(ModelSignatures {
        signature_defs,
        specs,
        init_op_listed,
    })
}

fn tensor_spec(info: &TensorInfo) -> TensorSpec {
    let shape = match &info.tensor_shape {
        Some(shape) if shape.unknown_rank => None,
        Some(shape) => Some(shape.dim.iter().map(|d| d.size).collect()),
        None => None,
    };
    TensorSpec {
        dtype: info.dtype,
        shape,
    }
}

impl ModelSignatures {
    pub fn select(&self, name: &str) -> Result<&SignatureSpec, ServingError> {
        let key = signature_key(name);
        self.specs.get(key).ok_or_else(|| {
            ServingError::new(
                Code::FailedPrecondition,
                format!("Serving signature key \"{key}\" not found."),
            )
        })
    }

    /// The inputs a REST Predict's JSON is read against, found as TF Serving's REST handler
    /// finds them (`GetInfoMap`): in the whole SignatureDefMap, so the init op's entry is found
    /// and has no inputs, which the JSON reader then refuses ("Failed to get input map"), as
    /// for any signature without inputs. A key the map lacks is INVALID_ARGUMENT here, not
    /// gRPC's FAILED_PRECONDITION.
    pub fn rest_inputs(
        &self,
        name: &str,
    ) -> Result<Cow<'_, HashMap<String, TensorSpec>>, ServingError> {
        let key = signature_key(name);
        if let Some(spec) = self.specs.get(key) {
            return Ok(Cow::Borrowed(&spec.inputs));
        }
        if key == INIT_OP_KEY && self.init_op_listed {
            return Ok(Cow::Owned(HashMap::new()));
        }
        Err(ServingError::invalid_argument(format!(
            "Serving signature name: \"{key}\" not found in signature def"
        )))
    }
}

/// The signature a request's name means: the default one when it names none.
fn signature_key(name: &str) -> &str {
    if name.is_empty() {
        DEFAULT_SIGNATURE
    } else {
        name
    }
}

/// INVALID_ARGUMENT unless `given` (alias, dtype, shape) fits the signature.
pub fn check_inputs(
    spec: &SignatureSpec,
    given: &[(&str, i32, &[i64])],
) -> Result<(), ServingError> {
    let expected: BTreeSet<&str> = spec.inputs.keys().map(String::as_str).collect();
    let sent: BTreeSet<&str> = given.iter().map(|(alias, _, _)| *alias).collect();
    if sent != expected || sent.len() != given.len() {
        let extra: BTreeSet<&str> = sent.difference(&expected).copied().collect();
        let missing: BTreeSet<&str> = expected.difference(&sent).copied().collect();
        return Err(ServingError::invalid_argument(format!(
            "input size does not match signature: {}!={} len({}) != len({}). Sent extra: {}. Missing but required: {}.",
            sent.len(),
            expected.len(),
            set(&sent),
            set(&expected),
            set(&extra),
            set(&missing)
        )));
    }
    // In alias order, so that a request with several wrong inputs always hears of the same one
    // (the request's inputs arrive as a map, in no particular order).
    let mut in_order: Vec<&(&str, i32, &[i64])> = given.iter().collect();
    in_order.sort_by_key(|(alias, _, _)| *alias);
    for (alias, dtype, shape) in in_order {
        let Some(want) = spec.inputs.get(*alias) else {
            continue; // unreachable: the alias sets are equal
        };
        if *dtype != want.dtype {
            return Err(ServingError::invalid_argument(format!(
                "input \"{alias}\": expects dtype {} but {} is provided",
                dtype_name(want.dtype),
                dtype_name(*dtype)
            )));
        }
        if !shape_fits(want.shape.as_deref(), shape) {
            return Err(ServingError::invalid_argument(format!(
                "input \"{alias}\": shape {} is not compatible with the signature's shape {}",
                shape_text(shape),
                want.shape_text()
            )));
        }
    }
    Ok(())
}

/// The output aliases to return: all of them (in name order) when the filter is empty.
pub fn check_output_filter(
    spec: &SignatureSpec,
    filter: &[String],
) -> Result<Vec<String>, ServingError> {
    if filter.is_empty() {
        return Ok(spec.output_names.clone());
    }
    // One pass in the filter's order, as TF Serving's (predict_util.cc): the first alias that
    // is unknown or seen before is the one named.
    let mut seen: BTreeSet<&String> = BTreeSet::new();
    for name in filter {
        if !spec.outputs.contains_key(name) {
            let all: BTreeSet<&str> = spec.outputs.keys().map(String::as_str).collect();
            return Err(ServingError::invalid_argument(format!(
                "output tensor alias not found in signature: {name} Outputs expected to be in the set {}.",
                set(&all)
            )));
        }
        if !seen.insert(name) {
            return Err(ServingError::invalid_argument(format!(
                "duplicate output tensor alias: {name}"
            )));
        }
    }
    // As a set: the same filter in another order shares a call (TF Serving's batching keys
    // on the set of names); the answer is a map either way.
    let mut outputs = filter.to_vec();
    outputs.sort_unstable();
    Ok(outputs)
}

pub fn shape_fits(want: Option<&[i64]>, got: &[i64]) -> bool {
    match want {
        None => true,
        Some(want) => {
            want.len() == got.len() && want.iter().zip(got).all(|(w, g)| *w < 0 || w == g)
        }
    }
}

fn set(names: &BTreeSet<&str>) -> String {
    format!(
        "{{{}}}",
        names.iter().copied().collect::<Vec<_>>().join(",")
    )
}

/// A shape as TF Serving's messages write it: `[2,-1,3]`.
pub fn shape_text(shape: &[i64]) -> String {
    let dims: Vec<String> = shape.iter().map(i64::to_string).collect();
    format!("[{}]", dims.join(","))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> SignatureSpec {
        let mut inputs = HashMap::new();
        inputs.insert(
            "ids".to_string(),
            TensorSpec {
                dtype: 9,
                shape: Some(vec![-1, 16]),
            },
        );
        inputs.insert(
            "dense".to_string(),
            TensorSpec {
                dtype: 1,
                shape: None,
            },
        );
        let mut outputs = HashMap::new();
        outputs.insert(
            "score".to_string(),
            TensorSpec {
                dtype: 1,
                shape: Some(vec![-1, 1]),
            },
        );
        outputs.insert(
            "logit".to_string(),
            TensorSpec {
                dtype: 1,
                shape: Some(vec![-1, 1]),
            },
        );
        SignatureSpec {
            key: "serving_default".into(),
            method_name: "tensorflow/serving/predict".into(),
            inputs,
            outputs,
            output_names: vec!["logit".into(), "score".into()],
        }
    }

    #[test]
    fn missing_and_extra_inputs_are_named_as_tf_serving_does() {
        let err = check_inputs(&spec(), &[("ids", 9, &[1, 16]), ("b", 1, &[1])]).unwrap_err();
        assert_eq!(
            err.message,
            "input size does not match signature: 2!=2 len({b,ids}) != len({dense,ids}). Sent extra: {b}. Missing but required: {dense}."
        );
    }

    #[test]
    fn dtype_and_shape_mismatches() {
        let err = check_inputs(&spec(), &[("ids", 1, &[1, 16]), ("dense", 1, &[1])]).unwrap_err();
        assert_eq!(
            err.message,
            "input \"ids\": expects dtype int64 but float is provided"
        );
        let err = check_inputs(&spec(), &[("ids", 9, &[1, 15]), ("dense", 1, &[1])]).unwrap_err();
        assert_eq!(
            err.message,
            "input \"ids\": shape [1,15] is not compatible with the signature's shape [-1,16]"
        );
        assert!(check_inputs(&spec(), &[("ids", 9, &[7, 16]), ("dense", 1, &[1, 2, 3])]).is_ok());
        // Two wrong inputs: the first in alias order is named, whatever order they came in.
        let err = check_inputs(&spec(), &[("ids", 1, &[1, 16]), ("dense", 9, &[1])]).unwrap_err();
        assert_eq!(
            err.message,
            "input \"dense\": expects dtype float but int64 is provided"
        );
    }

    #[test]
    fn outputs_with_a_row_per_input_row_are_those_declared_so() {
        let mut spec = spec();
        let mut declare = |name: &str, shape: Option<Vec<i64>>| {
            let tensor = TensorSpec { dtype: 1, shape };
            spec.outputs.insert(name.to_string(), tensor);
        };
        declare("vocabulary", Some(vec![3]));
        declare("total", Some(vec![]));
        declare("anything", None);
        let row_wise = |names: &[&str]| {
            let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
            spec.answers_row_by_row(&names)
        };
        assert!(row_wise(&["logit", "score"]));
        assert!(row_wise(&["anything", "score"]));
        assert!(!row_wise(&["score", "vocabulary"]));
        assert!(!row_wise(&["total"]));
    }

    #[test]
    fn a_signature_with_an_input_of_fixed_size_is_not_cut_by_rows() {
        let outputs = vec!["score".to_string()];
        assert!(spec().answers_row_by_row(&outputs));
        let with_input = |name: &str, shape: Option<Vec<i64>>| {
            let mut spec = spec();
            let tensor = TensorSpec { dtype: 1, shape };
            spec.inputs.insert(name.to_string(), tensor);
            spec.answers_row_by_row(&outputs)
        };
        assert!(with_input("any_rank", None), "nothing to go by");
        assert!(
            !with_input("table", Some(vec![4])),
            "4 weights, whatever the rows"
        );
        assert!(!with_input("scale", Some(vec![])), "a scalar");
    }

    #[test]
    fn output_filters() {
        assert_eq!(
            check_output_filter(&spec(), &[]).unwrap(),
            vec!["logit", "score"]
        );
        // A set: either order is the same filter, so such requests can share a call.
        for filter in [["score", "logit"], ["logit", "score"]] {
            let filter: Vec<String> = filter.map(String::from).into();
            assert_eq!(
                check_output_filter(&spec(), &filter).unwrap(),
                vec!["logit", "score"]
            );
        }
        let err = check_output_filter(&spec(), &["nope".into()]).unwrap_err();
        assert_eq!(
            err.message,
            "output tensor alias not found in signature: nope Outputs expected to be in the set {logit,score}."
        );
        let err = check_output_filter(&spec(), &["score".into(), "score".into()]).unwrap_err();
        assert_eq!(err.message, "duplicate output tensor alias: score");
        // The first problem in the filter's order is the one named.
        let err = check_output_filter(&spec(), &["logit".into(), "logit".into(), "nope".into()])
            .unwrap_err();
        assert_eq!(err.message, "duplicate output tensor alias: logit");
    }

    #[test]
    fn unknown_signature_is_failed_precondition() {
        let mut specs = HashMap::new();
        specs.insert("serving_default".to_string(), spec());
        let model = ModelSignatures {
            signature_defs: Bytes::new(),
            specs,
            init_op_listed: true,
        };
        assert!(model.select("").is_ok());
        let err = model.select("other").unwrap_err();
        assert_eq!(err.code, Code::FailedPrecondition);
        assert_eq!(err.message, "Serving signature key \"other\" not found.");
    }

    #[test]
    fn rest_finds_the_init_op_entry_a_grpc_predict_does_not() {
        use crate::proto::mpspool::tfs::SignatureDef;

        let with_inputs = SignatureDef {
            inputs: [("ids".to_string(), TensorInfo::default())].into(),
            ..Default::default()
        };
        let init_op = SignatureDef {
            outputs: [(INIT_OP_KEY.to_string(), TensorInfo::default())].into(),
            ..Default::default()
        };
        let read = |defs: Vec<(&str, SignatureDef)>| {
            let map = SignatureDefMap {
                signature_def: defs.into_iter().map(|(k, d)| (k.to_string(), d)).collect(),
            };
            parse(map.encode_to_vec().into()).unwrap()
        };
        let model = read(vec![
            ("serving_default", with_inputs.clone()),
            (INIT_OP_KEY, init_op),
        ]);
        assert!(model.init_op_listed);
        // gRPC cannot call it; REST finds it, with no inputs (the JSON reader refuses those).
        assert_eq!(
            model.select(INIT_OP_KEY).unwrap_err().code,
            Code::FailedPrecondition
        );
        assert!(model.rest_inputs(INIT_OP_KEY).unwrap().is_empty());
        assert_eq!(
            model
                .rest_inputs("serving_default")
                .unwrap()
                .keys()
                .collect::<Vec<_>>(),
            ["ids"]
        );
        let err = model.rest_inputs("other").unwrap_err();
        assert_eq!(err.code, Code::InvalidArgument);
        assert_eq!(
            err.message,
            "Serving signature name: \"other\" not found in signature def"
        );
        // A model saved without one (TF1's builder) does not list it: not found.
        let model = read(vec![("serving_default", with_inputs)]);
        assert!(!model.init_op_listed);
        assert_eq!(
            model.rest_inputs(INIT_OP_KEY).unwrap_err().message,
            "Serving signature name: \"__saved_model_init_op\" not found in signature def"
        );
    }
}
