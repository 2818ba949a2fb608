//! Classify, Regress and MultiInference on tf.Example inputs, as TF Serving's
//! `classifier.cc`, `regressor.cc` and `multi_inference.cc` run them:
//! - the request's `Input` becomes one DT_STRING tensor of serialized Examples, each with the
//!   shared context's bytes in front (protobuf merges concatenated messages, so the context's
//!   features join each example's: what `InputToSerializedExampleTensor` does). The front door
//!   never parses an Example; the model's own parse op does;
//! - the signature must have exactly one input, named `inputs`; a classification signature
//!   outputs `classes` (DT_STRING [batch, classes]) and/or `scores` (DT_FLOAT
//!   [batch, classes]), a regression signature one `outputs` (DT_FLOAT [batch] or [batch, 1]);
//! - the signature's method name is checked only with `--enable_signature_method_name_check`
//!   (off by default, as in TF Serving).
//!
//! The worker runs the signature like any other; the answer is checked and reshaped here.

use bytes::Bytes;

use crate::codec::{self, dtype_name, DT_FLOAT, DT_STRING};
use crate::dispatch::{WorkReply, WorkRequest};
use crate::proto::tensorflow::serving::{
    input::Kind, Class, ClassificationResult, Classifications, Input, Regression, RegressionResult,
};
use crate::signature::{shape_text, ModelSignatures, SignatureSpec, DEFAULT_SIGNATURE};
use crate::status::{Code, ServingError};
use crate::versions::Target;
use crate::wire;

pub const CLASSIFY_METHOD: &str = "tensorflow/serving/classify";
pub const REGRESS_METHOD: &str = "tensorflow/serving/regress";
pub const PREDICT_METHOD: &str = "tensorflow/serving/predict";

/// With `--enable_signature_method_name_check`, TF Serving's Predict takes a signature of any
/// of its three methods and refuses others with INTERNAL (predict_util.cc, VerifySignature).
pub fn check_predict_method(spec: &SignatureSpec) -> Result<(), ServingError> {
    let method = spec.method_name.as_str();
    if [PREDICT_METHOD, CLASSIFY_METHOD, REGRESS_METHOD].contains(&method) {
        return Ok(());
    }
    let message = format!(
        "Expected prediction signature method_name to be one of {{{PREDICT_METHOD}, \
         {CLASSIFY_METHOD}, {REGRESS_METHOD}}}. Was: {method}"
    );
    Err(ServingError::new(Code::Internal, message))
}
const INPUTS: &str = "inputs";
const CLASSES: &str = "classes";
const SCORES: &str = "scores";
const OUTPUTS: &str = "outputs";

/// What a request asks a signature for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Task {
    Classify,
    Regress,
}

impl Task {
    pub fn method_name(self) -> &'static str {
        match self {
            Task::Classify => CLASSIFY_METHOD,
            Task::Regress => REGRESS_METHOD,
        }
    }

    fn noun(self) -> &'static str {
        match self {
            Task::Classify => "classification",
            Task::Regress => "regression",
        }
    }
}

fn invalid(message: impl Into<String>) -> ServingError {
    ServingError::invalid_argument(message)
}

/// The bytes `examples` take once each has `context` in front of it.
pub fn merged_size(context: &[u8], examples: &[Bytes]) -> u64 {
    let own = examples
        .iter()
        .fold(0u64, |sum, e| sum.saturating_add(e.len() as u64));
    (context.len() as u64)
        .saturating_mul(examples.len() as u64)
        .saturating_add(own)
}

/// The serialized examples of `input`, the context's bytes in front of each; INVALID_ARGUMENT
/// "Input is empty." when there are none, or when they would take more than one string
/// tensor may (`codec::MAX_TENSOR_BYTES`): 1 MiB of context beside 400 empty examples had
/// the front door hold 1.3 GB for a 1 MiB request (found by a hunt).
pub fn serialized_examples(input: Option<&Input>) -> Result<Vec<Bytes>, ServingError> {
    let examples = match input.and_then(|i| i.kind.as_ref()) {
        None => Vec::new(),
        Some(Kind::ExampleList(list)) => list.examples.clone(),
        Some(Kind::ExampleListWithContext(list)) if list.context.is_empty() => {
            list.examples.clone()
        }
        Some(Kind::ExampleListWithContext(list))
            if merged_size(&list.context, &list.examples) > codec::MAX_TENSOR_BYTES =>
        {
            return Err(invalid(format!(
                "{} examples with a context of {} bytes in front of each take {} bytes, more \
                 than the {} one tensor may have",
                list.examples.len(),
                list.context.len(),
                merged_size(&list.context, &list.examples),
                codec::MAX_TENSOR_BYTES
            )));
        }
        Some(Kind::ExampleListWithContext(list)) => list
            .examples
            .iter()
            .map(|example| {
                let mut merged = Vec::with_capacity(list.context.len() + example.len());
                merged.extend_from_slice(&list.context);
                merged.extend_from_slice(example);
                Bytes::from(merged)
            })
            .collect(),
    };
    if examples.is_empty() {
        return Err(invalid("Input is empty."));
    }
    Ok(examples)
}

/// The signature a Classify or Regress names ("" → serving_default), checked as TF Serving's
/// `Get{Classification,Regression}SignatureDef` and `PreProcess*` do; with it, the outputs to
/// ask the worker for.
pub fn signature_for<'a>(
    signatures: &'a ModelSignatures,
    name: &str,
    task: Task,
    check_method_name: bool,
) -> Result<(&'a SignatureSpec, Vec<String>), ServingError> {
    let key = if name.is_empty() {
        DEFAULT_SIGNATURE
    } else {
        name
    };
    let spec = signatures
        .specs
        .get(key)
        .ok_or_else(|| invalid(format!("No signature was found with the name: {key}")))?;
    if check_method_name {
        check_method(spec, task)?;
    }
    let outputs = preprocess(spec, task)?;
    Ok((spec, outputs))
}

fn check_method(spec: &SignatureSpec, task: Task) -> Result<(), ServingError> {
    if spec.method_name != task.method_name() {
        return Err(invalid(format!(
            "Expected {} signature method_name to be {}. Was: {}",
            task.noun(),
            task.method_name(),
            spec.method_name
        )));
    }
    Ok(())
}

/// The serialized Examples are a string tensor fed to the signature's input: TensorFlow's
/// session refuses a feed of another dtype (FunctionCallFrame::SetArgs), and TF Serving passes
/// its error on once the request's other checks and its examples have passed. Checked before
/// any worker is sent a call it cannot make.
pub fn check_feed(spec: &SignatureSpec) -> Result<(), ServingError> {
    let input = spec
        .inputs
        .get(INPUTS)
        .map_or(DT_STRING, |input| input.dtype);
    if input != DT_STRING {
        return Err(invalid(format!(
            "Expects arg[0] to be {} but string is provided",
            dtype_name(input)
        )));
    }
    Ok(())
}

/// TF Serving's `PreProcessClassification` / `PreProcessRegression` (the signature's shape of
/// inputs and outputs), giving the output aliases to run.
fn preprocess(spec: &SignatureSpec, task: Task) -> Result<Vec<String>, ServingError> {
    if spec.inputs.len() != 1 {
        return Err(invalid("Expected one input Tensor."));
    }
    match task {
        Task::Classify => {
            let n = spec.outputs.len();
            if n != 1 && n != 2 {
                return Err(invalid(format!(
                    "Expected one or two output Tensors, found {n}"
                )));
            }
        }
        Task::Regress => {
            if spec.outputs.len() != 1 {
                return Err(invalid("Expected one output Tensor."));
            }
        }
    }
    if !spec.inputs.contains_key(INPUTS) {
        return Err(invalid(format!(
            "No {} inputs found in SignatureDef: {}",
            task.noun(),
            spec.key
        )));
    }
    match task {
        Task::Classify => {
            let outputs: Vec<String> = [CLASSES, SCORES]
                .into_iter()
                .filter(|name| spec.outputs.contains_key(*name))
                .map(str::to_string)
                .collect();
            if outputs.is_empty() {
                return Err(invalid(format!(
                    "Expected classification signature outputs to contain at least one of \"{CLASSES}\" or \"{SCORES}\". Signature was: {}",
                    spec.key
                )));
            }
            Ok(outputs)
        }
        Task::Regress => {
            if !spec.outputs.contains_key(OUTPUTS) {
                return Err(invalid(format!(
                    "No regression outputs found in SignatureDef: {}",
                    spec.key
                )));
            }
            Ok(vec![OUTPUTS.to_string()])
        }
    }
}

/// The worker call: the examples as the signature's `inputs` string tensor.
pub fn work(
    target: Target,
    spec: &SignatureSpec,
    outputs: Vec<String>,
    examples: &[Bytes],
) -> WorkRequest {
    WorkRequest {
        target,
        signature: spec.key.clone(),
        tensors: vec![(INPUTS.to_string(), DT_STRING, vec![examples.len() as i64])],
        frames: vec![Bytes::from(wire::encode_strings(examples))],
        row_wise: spec.answers_row_by_row(&outputs),
        outputs,
        memory: Default::default(),
    }
}

/// One output of a worker's reply: its dtype, shape and frame.
fn output<'a>(reply: &'a WorkReply, name: &str) -> Option<(i32, &'a [i64], &'a Bytes)> {
    reply
        .tensors
        .iter()
        .zip(&reply.frames)
        .find(|((alias, _, _), _)| alias == name)
        .map(|((_, dtype, shape), frame)| (*dtype, shape.as_slice(), frame))
}

fn dt_name(dtype: i32) -> String {
    format!("DT_{}", dtype_name(dtype).to_ascii_uppercase())
}

fn floats(dtype: i32, shape: &[i64], frame: &Bytes) -> Result<Vec<f32>, ServingError> {
    Ok(codec::output_tensor_typed(dtype, shape, frame.clone())?.float_val)
}

/// TF Serving's `PostProcessClassificationResult`.
pub fn classification_result(
    reply: &WorkReply,
    examples: usize,
) -> Result<ClassificationResult, ServingError> {
    let check = |what: &str, shape: &[i64], dtype: i32, want: i32| {
        if shape.len() != 2 {
            return Err(invalid(format!(
                "Expected Tensor shape: [batch_size num_classes] but got {}",
                shape_text(shape)
            )));
        }
        if dtype != want {
            return Err(invalid(format!(
                "Expected {what} Tensor of {}. Got: {}",
                dt_name(want),
                dt_name(dtype)
            )));
        }
        if shape[0] != examples as i64 {
            return Err(invalid(format!(
                "Expected {what} output batch size of {examples}. Got: {}",
                shape[0]
            )));
        }
        Ok(shape[1])
    };
    let classes = output(reply, CLASSES);
    let scores = output(reply, SCORES);
    let mut width = None;
    let labels = match classes {
        Some((dtype, shape, frame)) => {
            width = Some(check("classes", shape, dtype, DT_STRING)?);
            Some(codec::output_tensor_typed(dtype, shape, frame.clone())?.string_val)
        }
        None => None,
    };
    let values = match scores {
        Some((dtype, shape, frame)) => {
            let n = check("scores", shape, dtype, DT_FLOAT)?;
            if let Some(classes) = width.filter(|&c| c != n) {
                return Err(invalid(format!(
                    "Tensors class and score should match in dim_size(1). Got {classes} vs. {n}"
                )));
            }
            width = Some(n);
            Some(floats(dtype, shape, frame)?)
        }
        None => None,
    };
    let width = width.unwrap_or(0) as usize;
    let classifications = (0..examples)
        .map(|i| Classifications {
            classes: (0..width)
                .map(|c| Class {
                    label: labels
                        .as_ref()
                        .map(|l| String::from_utf8_lossy(&l[i * width + c]).into_owned())
                        .unwrap_or_default(),
                    score: values.as_ref().map_or(0.0, |v| v[i * width + c]),
                })
                .collect(),
        })
        .collect();
    Ok(ClassificationResult { classifications })
}

/// TF Serving's `PostProcessRegressionResult`.
pub fn regression_result(
    reply: &WorkReply,
    examples: usize,
) -> Result<RegressionResult, ServingError> {
    let Some((dtype, shape, frame)) = output(reply, OUTPUTS) else {
        return Err(invalid(format!("Could not find output tensor '{OUTPUTS}'")));
    };
    if !(shape.len() == 1 || (shape.len() == 2 && shape[1] == 1)) {
        return Err(invalid(format!(
            "Expected output Tensor shape to be either [batch_size] or [batch_size, 1] but got {}",
            shape_text(shape)
        )));
    }
    if shape[0] != examples as i64 {
        return Err(invalid(format!(
            "Input batch size did not match output batch size: {examples} vs. {}",
            shape[0]
        )));
    }
    if dtype != DT_FLOAT {
        return Err(invalid(format!(
            "Expected output Tensor of DT_FLOAT.  Got: {}",
            dt_name(dtype)
        )));
    }
    let values = floats(dtype, shape, frame)?;
    Ok(RegressionResult {
        regressions: values
            .into_iter()
            .map(|value| Regression { value })
            .collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::tensorflow::serving::{ExampleList, ExampleListWithContext};
    use crate::signature::TensorSpec;
    use std::collections::HashMap;

    fn spec(method: &str, inputs: &[&str], outputs: &[(&str, i32)]) -> SignatureSpec {
        let tensor = |dtype| TensorSpec { dtype, shape: None };
        SignatureSpec {
            key: "sig".into(),
            method_name: method.into(),
            inputs: inputs
                .iter()
                .map(|n| (n.to_string(), tensor(DT_STRING)))
                .collect(),
            outputs: outputs
                .iter()
                .map(|(n, d)| (n.to_string(), tensor(*d)))
                .collect(),
            output_names: outputs.iter().map(|(n, _)| n.to_string()).collect(),
        }
    }

    #[test]
    fn predict_takes_a_signature_of_the_three_methods_when_they_are_checked() {
        for method in [PREDICT_METHOD, CLASSIFY_METHOD, REGRESS_METHOD] {
            assert!(check_predict_method(&spec(method, &["x"], &[])).is_ok());
        }
        let refused = check_predict_method(&spec("custom/method", &["x"], &[])).unwrap_err();
        assert_eq!(
            refused,
            ServingError::new(
                Code::Internal,
                "Expected prediction signature method_name to be one of \
                 {tensorflow/serving/predict, tensorflow/serving/classify, \
                 tensorflow/serving/regress}. Was: custom/method"
            )
        );
    }

    fn signatures(specs: Vec<SignatureSpec>) -> ModelSignatures {
        ModelSignatures {
            signature_defs: Bytes::new(),
            specs: specs
                .into_iter()
                .map(|s| (s.key.clone(), s))
                .collect::<HashMap<_, _>>(),
            init_op_listed: false,
        }
    }

    #[test]
    fn examples_carry_the_context_in_front() {
        let input = Input {
            kind: Some(Kind::ExampleListWithContext(ExampleListWithContext {
                examples: vec![Bytes::from_static(b"AB"), Bytes::from_static(b"C")],
                context: Bytes::from_static(b"ctx"),
            })),
        };
        assert_eq!(
            serialized_examples(Some(&input)).unwrap(),
            vec![Bytes::from_static(b"ctxAB"), Bytes::from_static(b"ctxC")]
        );
        let empty = Input {
            kind: Some(Kind::ExampleList(ExampleList { examples: vec![] })),
        };
        assert_eq!(
            serialized_examples(Some(&empty)).unwrap_err().message,
            "Input is empty."
        );
        assert_eq!(
            serialized_examples(None).unwrap_err().message,
            "Input is empty."
        );
    }

    #[test]
    fn a_context_repeated_past_one_tensors_size_is_refused_before_it_is_copied() {
        // 1 MiB of context in front of each of 2,049 empty examples: 2 GiB and 1 MiB.
        let context = Bytes::from(vec![b'c'; 1 << 20]);
        let input = Input {
            kind: Some(Kind::ExampleListWithContext(ExampleListWithContext {
                examples: vec![Bytes::new(); 2049],
                context: context.clone(),
            })),
        };
        let refused = serialized_examples(Some(&input)).unwrap_err();
        assert_eq!(refused.code, crate::status::Code::InvalidArgument);
        assert!(refused.message.starts_with(
            "2049 examples with a context of 1048576 bytes in front of each take 2148532224 bytes"
        ));
        // What a request's budget counts: the copies too (once per example).
        let input = Input {
            kind: Some(Kind::ExampleListWithContext(ExampleListWithContext {
                examples: vec![Bytes::new(); 2048],
                context,
            })),
        };
        assert!(crate::decode_budget::input_memory(&input) > 2048 << 20);
    }

    #[test]
    fn signatures_are_checked_as_tf_serving_checks_them() {
        let sigs = signatures(vec![
            spec(
                CLASSIFY_METHOD,
                &["inputs"],
                &[("classes", DT_STRING), ("scores", DT_FLOAT)],
            ),
            SignatureSpec {
                key: "two".into(),
                ..spec("tensorflow/serving/predict", &["a", "b"], &[("x", 1)])
            },
            SignatureSpec {
                key: "predict".into(),
                ..spec(
                    "tensorflow/serving/predict",
                    &["inputs"],
                    &[("outputs", DT_FLOAT)],
                )
            },
            SignatureSpec {
                key: "float_in".into(),
                inputs: [(
                    "inputs".to_string(),
                    TensorSpec {
                        dtype: DT_FLOAT,
                        shape: None,
                    },
                )]
                .into(),
                ..spec(REGRESS_METHOD, &[], &[("outputs", DT_FLOAT)])
            },
        ]);
        let (_, outputs) = signature_for(&sigs, "sig", Task::Classify, true).unwrap();
        assert_eq!(outputs, vec!["classes", "scores"]);
        let message = |name: &str, task: Task, check: bool| {
            signature_for(&sigs, name, task, check).unwrap_err().message
        };
        assert_eq!(
            message("", Task::Classify, false),
            "No signature was found with the name: serving_default"
        );
        assert_eq!(
            message("two", Task::Regress, false),
            "Expected one input Tensor."
        );
        assert_eq!(
            message("sig", Task::Regress, false),
            "Expected one output Tensor."
        );
        assert_eq!(
            message("predict", Task::Regress, true),
            "Expected regression signature method_name to be tensorflow/serving/regress. Was: tensorflow/serving/predict"
        );
        // What TensorFlow's session says of a string feed to a float input (all else right).
        let (float_in, _) = signature_for(&sigs, "float_in", Task::Regress, true).unwrap();
        assert_eq!(
            check_feed(float_in).unwrap_err().message,
            "Expects arg[0] to be float but string is provided"
        );
        let (string_in, _) = signature_for(&sigs, "sig", Task::Classify, true).unwrap();
        assert!(check_feed(string_in).is_ok());
        // Without the method-name check a predict signature of the right shape serves.
        assert!(signature_for(&sigs, "predict", Task::Regress, false).is_ok());
        assert!(message("predict", Task::Classify, false)
            .starts_with("Expected classification signature outputs to contain at least one of"));
    }

    fn reply(outputs: Vec<(&str, i32, Vec<i64>, Bytes)>) -> WorkReply {
        let (tensors, frames) = outputs
            .into_iter()
            .map(|(n, d, s, f)| ((n.to_string(), d, s), f))
            .unzip();
        WorkReply {
            tensors,
            frames,
            slot: "cpu-0".into(),
            version: 1,
            span: None,
        }
    }

    fn float_frame(values: &[f32]) -> Bytes {
        Bytes::from(
            values
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect::<Vec<u8>>(),
        )
    }

    #[test]
    fn answers_are_checked_and_reshaped() {
        let classes = Bytes::from(wire::encode_strings(&[b"a".as_slice(), b"b", b"a", b"b"]));
        let answer = reply(vec![
            ("classes", DT_STRING, vec![2, 2], classes),
            (
                "scores",
                DT_FLOAT,
                vec![2, 2],
                float_frame(&[0.1, 0.9, 0.7, 0.3]),
            ),
        ]);
        let result = classification_result(&answer, 2).unwrap();
        assert_eq!(result.classifications.len(), 2);
        assert_eq!(result.classifications[1].classes[0].label, "a");
        assert_eq!(result.classifications[1].classes[0].score, 0.7);
        assert_eq!(
            classification_result(&answer, 3).unwrap_err().message,
            "Expected classes output batch size of 3. Got: 2"
        );
        let scores_only = reply(vec![(
            "scores",
            DT_FLOAT,
            vec![1, 3],
            float_frame(&[1.0, 2.0, 3.0]),
        )]);
        let result = classification_result(&scores_only, 1).unwrap();
        assert_eq!(result.classifications[0].classes[2].score, 3.0);
        assert_eq!(result.classifications[0].classes[2].label, "");
        let flat = reply(vec![(
            "scores",
            DT_FLOAT,
            vec![3],
            float_frame(&[1.0, 2.0, 3.0]),
        )]);
        assert_eq!(
            classification_result(&flat, 3).unwrap_err().message,
            "Expected Tensor shape: [batch_size num_classes] but got [3]"
        );

        let column = reply(vec![(
            "outputs",
            DT_FLOAT,
            vec![2, 1],
            float_frame(&[0.5, 1.5]),
        )]);
        let result = regression_result(&column, 2).unwrap();
        assert_eq!(result.regressions[1].value, 1.5);
        assert_eq!(
            regression_result(&column, 1).unwrap_err().message,
            "Input batch size did not match output batch size: 1 vs. 2"
        );
        let wide = reply(vec![(
            "outputs",
            DT_FLOAT,
            vec![1, 2],
            float_frame(&[0.5, 1.5]),
        )]);
        assert!(regression_result(&wide, 1)
            .unwrap_err()
            .message
            .starts_with(
                "Expected output Tensor shape to be either [batch_size] or [batch_size, 1]"
            ));
        let ints = reply(vec![(
            "outputs",
            codec::DT_INT64,
            vec![1],
            Bytes::from(vec![0u8; 8]),
        )]);
        assert_eq!(
            regression_result(&ints, 1).unwrap_err().message,
            "Expected output Tensor of DT_FLOAT.  Got: DT_INT64"
        );
    }
}
