//! lockstep's dequantizer against the `gguf` Python package's numpy implementation
//! (goldens from `gpu/tests/goldens/make_dequant_goldens.py`): random blocks of every type, and
//! the default model's tensors when it has been fetched (CI requires it).

#![allow(clippy::unwrap_used, reason = "test code: a panic is the failure report")]

mod common;

use lockstep_gpu::gguf::{TensorType, dequantize};
use serde_json::Value;

fn goldens() -> Value {
    serde_json::from_str(include_str!("goldens/dequant.json")).unwrap()
}

fn kind(name: &str) -> TensorType {
    match name {
        "F32" => TensorType::F32,
        "F16" => TensorType::F16,
        "BF16" => TensorType::BF16,
        "Q4_0" => TensorType::Q4_0,
        "Q4_1" => TensorType::Q4_1,
        "Q8_0" => TensorType::Q8_0,
        "Q4_K" => TensorType::Q4K,
        "Q6_K" => TensorType::Q6K,
        "Q5_0" => TensorType::Q5_0,
        "Q5_1" => TensorType::Q5_1,
        "Q5_K" => TensorType::Q5K,
        other => panic!("unknown type {other} in the goldens"),
    }
}

fn hex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
}

/// numpy computes these in f32 as ggml does; the only freedom is the order of a product of
/// three factors in the K-quants, worth an ulp or two.
fn close(a: f32, b: f32) -> bool {
    a == b || (a - b).abs() <= 4.0 * f32::EPSILON * a.abs().max(b.abs())
}

#[test]
fn random_blocks_of_every_type_match_numpy() {
    let goldens = goldens();
    for (name, entry) in goldens["random"].as_object().unwrap() {
        let kind = kind(name);
        let bytes = hex(entry["bytes"].as_str().unwrap());
        let expected: Vec<f32> = entry["values"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap() as f32)
            .collect();
        let mut out = vec![0f32; expected.len()];
        dequantize(kind, &bytes, &mut out);
        for (i, (got, want)) in out.iter().zip(&expected).enumerate() {
            assert!(close(*got, *want), "{name} value {i}: {got} vs numpy {want}");
        }
    }
}

#[test]
fn the_default_model_matches_numpy() {
    let Some((_, file)) = common::default_model() else { return };
    let gguf = common::parse(&file);
    let goldens = goldens();
    let model = goldens["model"].as_object().unwrap();
    assert_eq!(model.len(), gguf.tensors.len());
    for info in &gguf.tensors {
        let entry = &model[&info.name];
        let row = info.dims[0] as usize;
        let rows = (info.elements() as usize / row).min(64);
        let row_bytes = info.bytes as usize / (info.elements() as usize / row);
        let data = gguf.tensor_data(&file, info);
        let mut out = vec![0f32; rows * row];
        dequantize(info.kind, &data[..rows * row_bytes], &mut out);
        let sum: f64 = out.iter().map(|&v| f64::from(v)).sum();
        let want = entry["sum_first_64_rows"].as_f64().unwrap();
        assert!(
            (sum - want).abs() <= 1e-4 * want.abs().max(1.0),
            "{}: sum {sum} vs numpy {want}",
            info.name
        );
        if let Some(first) = entry.get("first_rows") {
            for (r, row_values) in first.as_array().unwrap().iter().enumerate() {
                for (i, v) in row_values.as_array().unwrap().iter().enumerate() {
                    let (got, want) = (out[r * row + i], v.as_f64().unwrap() as f32);
                    assert!(
                        close(got, want),
                        "{} row {r} value {i}: {got} vs numpy {want}",
                        info.name
                    );
                }
            }
        }
    }
}

#[test]
fn half_precision_edges() {
    use lockstep_gpu::gguf::{bf16_to_f32, f16_to_f32};
    assert_eq!(f16_to_f32(0x3c00), 1.0);
    assert_eq!(f16_to_f32(0xc000), -2.0);
    assert_eq!(f16_to_f32(0x7bff), 65504.0);
    assert_eq!(f16_to_f32(0x0001), 2f32.powi(-24), "smallest subnormal");
    assert_eq!(f16_to_f32(0x8001), -(2f32.powi(-24)));
    assert_eq!(f16_to_f32(0x03ff), 1023.0 * 2f32.powi(-24), "largest subnormal");
    assert!(f16_to_f32(0x8000).is_sign_negative() && f16_to_f32(0x8000) == 0.0);
    assert_eq!(f16_to_f32(0x7c00), f32::INFINITY);
    assert!(f16_to_f32(0x7e00).is_nan());
    assert_eq!(bf16_to_f32(0x3f80), 1.0);
    // Every finite f16 round-trips through f32 exactly (checked against the definition).
    for bits in 0..=u16::MAX {
        let v = f16_to_f32(bits);
        let e = (bits >> 10) & 0x1f;
        if e != 0x1f {
            let m = f32::from(bits & 0x3ff);
            let magnitude = if e == 0 {
                m * 2f32.powi(-24)
            } else {
                (1.0 + m / 1024.0) * 2f32.powi(i32::from(e) - 15)
            };
            assert_eq!(v.abs(), magnitude, "bits {bits:#06x}");
        }
    }
}

#[test]
fn single_to_half_rounds_to_nearest_even_and_round_trips() {
    use lockstep_gpu::gguf::{f16_to_f32, f32_to_f16};
    for bits in 0..=u16::MAX {
        let v = f16_to_f32(bits);
        if v.is_nan() {
            assert!(f16_to_f32(f32_to_f16(v)).is_nan());
        } else {
            assert_eq!(f32_to_f16(v), bits, "{v} did not round-trip");
        }
    }
    assert_eq!(f32_to_f16(1.0 + 2f32.powi(-11)), 0x3c00, "a tie rounds to even (down)");
    assert_eq!(f32_to_f16(1.0 + 3.0 * 2f32.powi(-11)), 0x3c02, "a tie rounds to even (up)");
    assert_eq!(f32_to_f16(65520.0), 0x7c00, "overflow is infinity");
    assert_eq!(f32_to_f16(2f32.powi(-26)), 0, "below half the smallest subnormal is zero");
    assert_eq!(f32_to_f16(3.0 * 2f32.powi(-26)), 1, "above it rounds up to the smallest subnormal");
}
