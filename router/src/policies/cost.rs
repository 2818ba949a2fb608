//! Expected compute time of a request, learned online from what workers report.
//!
//! Per model and signature, a least-squares line `µs = fixed + per_row × rows` over recent model calls
//! (sums decayed by `DECAY` per observation, so the estimate follows a model whose cost
//! changes — a GPU that warms up, a neighbour on the CPU). Workers stamp each reply with the
//! model call's start and end; that span, not the round trip, is the observation, so queueing
//! does not leak into the cost. Before a signature has observations the estimate borrows the
//! line of all signatures together (of every model: a first guess in the right units), and before anything is known it is the row count (µs per
//! row 1): any of these orders requests of one signature by their rows, which is what SJF
//! needs most.

use std::collections::HashMap;

use crate::versions::ModelId;

/// Weight kept by older observations at each new one: an effective memory of ~200 calls.
const DECAY: f64 = 0.995;

#[derive(Clone, Copy, Default, Debug)]
struct Fit {
    weight: f64,
    rows: f64,
    micros: f64,
    rows_sq: f64,
    rows_micros: f64,
}

impl Fit {
    fn observe(&mut self, rows: f64, micros: f64) {
        self.weight = self.weight * DECAY + 1.0;
        self.rows = self.rows * DECAY + rows;
        self.micros = self.micros * DECAY + micros;
        self.rows_sq = self.rows_sq * DECAY + rows * rows;
        self.rows_micros = self.rows_micros * DECAY + rows * micros;
    }

    fn estimate(&self, rows: f64) -> Option<f64> {
        if self.weight <= 0.0 {
            return None;
        }
        let mean_rows = self.rows / self.weight;
        let mean_micros = self.micros / self.weight;
        let variance = self.rows_sq / self.weight - mean_rows * mean_rows;
        let per_row = if variance > 1e-6 * mean_rows.max(1.0).powi(2) {
            // Noise can tilt the line downwards; compute never gets cheaper with more rows.
            ((self.rows_micros / self.weight - mean_rows * mean_micros) / variance).max(0.0)
        } else {
            // One size seen so far: proportional to rows.
            mean_micros / mean_rows.max(1.0)
        };
        let fixed = (mean_micros - per_row * mean_rows).max(0.0);
        Some(fixed + per_row * rows)
    }
}

#[derive(Default)]
pub struct CostModel {
    /// Model → signature → its line (nested, so a lookup on the request path allocates
    /// nothing).
    by_signature: HashMap<ModelId, HashMap<String, Fit>>,
    all: Fit,
}

impl CostModel {
    /// A model call of `model`'s `signature` on `rows` rows took `micros`.
    pub fn observe(&mut self, model: ModelId, signature: &str, rows: u64, micros: f64) {
        if !micros.is_finite() || micros < 0.0 {
            return;
        }
        let rows = rows.max(1) as f64;
        let signatures = self.by_signature.entry(model).or_default();
        match signatures.get_mut(signature) {
            Some(fit) => fit.observe(rows, micros),
            None => {
                let mut fit = Fit::default();
                fit.observe(rows, micros);
                signatures.insert(signature.to_string(), fit);
            }
        }
        self.all.observe(rows, micros);
    }

    /// Expected µs of a call of `model`'s `signature` on `rows` rows.
    pub fn estimate(&self, model: ModelId, signature: &str, rows: u64) -> f64 {
        let rows = rows.max(1) as f64;
        self.by_signature
            .get(&model)
            .and_then(|signatures| signatures.get(signature))
            .and_then(|fit| fit.estimate(rows))
            .or_else(|| self.all.estimate(rows))
            .unwrap_or(rows)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn learns_fixed_and_per_row_cost() {
        let mut model = CostModel::default();
        for i in 0..200u64 {
            let rows = [1, 8, 64, 512][(i % 4) as usize];
            model.observe(0, "serving_default", rows, 250.0 + 2.0 * rows as f64);
        }
        let at = |rows| model.estimate(0, "serving_default", rows);
        assert!((at(1) - 252.0).abs() < 1.0, "{}", at(1));
        assert!((at(2048) - 4346.0).abs() < 5.0, "{}", at(2048));
    }

    #[test]
    fn one_size_seen_is_proportional_and_unknowns_borrow() {
        let mut model = CostModel::default();
        assert_eq!(model.estimate(0, "x", 7), 7.0);
        for _ in 0..10 {
            model.observe(0, "a", 4, 400.0);
        }
        assert!((model.estimate(0, "a", 8) - 800.0).abs() < 1e-6);
        // "b" has no observations: it borrows the pooled line.
        assert!((model.estimate(0, "b", 2) - 200.0).abs() < 1e-6);
        // Signatures are kept apart.
        for _ in 0..10 {
            model.observe(0, "b", 4, 40.0);
        }
        assert!((model.estimate(0, "b", 4) - 40.0).abs() < 1e-6);
        assert!((model.estimate(0, "a", 4) - 400.0).abs() < 1e-6);
    }

    #[test]
    fn follows_a_model_that_gets_slower_and_ignores_nonsense() {
        let mut model = CostModel::default();
        for _ in 0..500 {
            model.observe(0, "s", 1, 100.0);
        }
        for _ in 0..1000 {
            model.observe(0, "s", 1, 300.0);
        }
        model.observe(0, "s", 1, f64::NAN);
        model.observe(0, "s", 1, -5.0);
        assert!((model.estimate(0, "s", 1) - 300.0).abs() < 5.0);
    }

    #[test]
    fn models_with_the_same_signature_name_are_apart() {
        let mut model = CostModel::default();
        for _ in 0..50 {
            model.observe(0, "serving_default", 1, 100.0);
            model.observe(1, "serving_default", 1, 5000.0);
        }
        assert!((model.estimate(0, "serving_default", 1) - 100.0).abs() < 1e-6);
        assert!((model.estimate(1, "serving_default", 1) - 5000.0).abs() < 1e-6);
    }
}
