//! Log lines on stderr (supervisord captures them into the router's log file), in the format
//! the Python processes of the pool use: `2026-11-22 10:43:00,123 router INFO message`.
//! Four macros and no logging crate: the front door logs events, never per request.

use std::time::{SystemTime, UNIX_EPOCH};

/// UTC `YYYY-MM-DD HH:MM:SS,mmm` (days-from-civil arithmetic, no time-zone database needed).
pub fn timestamp() -> String {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    let secs = now.as_secs() as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02},{:03}",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        now.subsec_millis()
    )
}

#[macro_export]
macro_rules! log_at {
    ($level:expr, $($arg:tt)*) => {
        eprintln!("{} router {} {}", $crate::log::timestamp(), $level, format_args!($($arg)*))
    };
}
#[macro_export]
macro_rules! log_info { ($($arg:tt)*) => { $crate::log_at!("INFO", $($arg)*) }; }
#[macro_export]
macro_rules! log_warn { ($($arg:tt)*) => { $crate::log_at!("WARNING", $($arg)*) }; }
#[macro_export]
macro_rules! log_error { ($($arg:tt)*) => { $crate::log_at!("ERROR", $($arg)*) }; }

#[cfg(test)]
mod tests {
    #[test]
    fn timestamps_have_the_python_shape() {
        let t = super::timestamp();
        assert_eq!(t.len(), 23, "{t}");
        assert_eq!(&t[4..5], "-");
        assert_eq!(&t[19..20], ",");
        assert!(t.starts_with("20"));
    }
}
