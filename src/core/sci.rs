//! One way to print a float in a table cell or a finding: scientific notation with a fixed
//! number of digits after the point, exact zeros as `0`, and non-finite values as Rust writes
//! them (`NaN`, `inf`, `-inf`), so that the reports and the detectors' evidence read alike.

/// `x` as `d.ddde±N` with `digits` digits after the point (`1.235e-3` for 3), `0` for an exact
/// zero, `NaN`/`inf`/`-inf` for a non-finite value.
pub fn sci(x: f64, digits: usize) -> String {
    if x == 0.0 {
        "0".into()
    } else if x.is_finite() {
        format!("{x:.digits$e}")
    } else {
        format!("{x}")
    }
}

#[cfg(test)]
mod tests {
    use super::sci;

    #[test]
    fn zero_finite_and_special_values() {
        assert_eq!(sci(0.0, 3), "0");
        assert_eq!(sci(-0.0, 2), "0");
        assert_eq!(sci(0.0012345, 3), "1.234e-3");
        assert_eq!(sci(-1234.5, 2), "-1.23e3");
        assert_eq!(sci(f64::NAN, 3), "NaN");
        assert_eq!(sci(f64::NEG_INFINITY, 2), "-inf");
    }
}
