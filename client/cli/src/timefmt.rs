//! Timestamps given on the command line or in CSV fields, to milliseconds
//! since the Unix epoch:
//! - integer milliseconds: `1700000000000`;
//! - RFC 3339: `2013-01-01T10:00:00Z`, `2013-01-01T05:00:00.250-05:00`;
//! - `YYYY-MM-DD HH:MM[:SS[.fff]]` and `YYYY-MM-DD`, taken as UTC.

/// Parses a timestamp in one of the accepted forms (see the module docs).
///
/// # Errors
/// A message saying what is wrong with `text`.
pub fn parse_timestamp_ms(text: &str) -> Result<i64, String> {
    let s = text.trim();
    if s.is_empty() {
        return Err("empty timestamp".into());
    }
    let digits = s.strip_prefix('-').unwrap_or(s);
    if digits.bytes().all(|b| b.is_ascii_digit()) {
        return s.parse::<i64>().map_err(|e| format!("timestamp {s:?}: {e}"));
    }
    parse_datetime(s).map_err(|why| {
        format!(
            "cannot read {s:?} as a time ({why}); use RFC 3339 (2013-01-01T10:00:00Z), \
             \"YYYY-MM-DD HH:MM:SS\" (UTC) or integer milliseconds"
        )
    })
}

/// A cursor over the ASCII text of a date-time.
struct Cursor<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl Cursor<'_> {
    fn number(&mut self, width: usize, what: &str) -> Result<i64, String> {
        let end = self.at + width;
        let Some(chunk) = self.bytes.get(self.at..end) else { return Err(format!("{what} is cut short")) };
        if !chunk.iter().all(u8::is_ascii_digit) {
            return Err(format!("{what} must be {width} digits"));
        }
        self.at = end;
        Ok(chunk.iter().fold(0, |n, b| n * 10 + i64::from(b - b'0')))
    }

    fn eat(&mut self, options: &[u8]) -> Option<u8> {
        let b = *self.bytes.get(self.at)?;
        if options.contains(&b) {
            self.at += 1;
            Some(b)
        } else {
            None
        }
    }

    fn expect(&mut self, b: u8, what: &str) -> Result<(), String> {
        self.eat(&[b]).map(|_| ()).ok_or_else(|| format!("expected '{}' {what}", b as char))
    }

    fn done(&self) -> bool {
        self.at == self.bytes.len()
    }
}

fn parse_datetime(s: &str) -> Result<i64, String> {
    let mut c = Cursor { bytes: s.as_bytes(), at: 0 };
    let year = c.number(4, "the year")?;
    c.expect(b'-', "after the year")?;
    let month = c.number(2, "the month")?;
    c.expect(b'-', "after the month")?;
    let day = c.number(2, "the day")?;
    if !(1..=12).contains(&month) {
        return Err(format!("month {month} is not 1-12"));
    }
    if day < 1 || day > days_in_month(year, month) {
        return Err(format!("day {day} is not in {year}-{month:02}"));
    }
    let (mut hour, mut minute, mut second, mut millis) = (0, 0, 0, 0);
    let mut offset_minutes = 0;
    if !c.done() {
        c.eat(b"Tt ").ok_or("expected 'T' or a space after the date")?;
        hour = c.number(2, "the hour")?;
        c.expect(b':', "after the hour")?;
        minute = c.number(2, "the minute")?;
        if c.eat(b":").is_some() {
            second = c.number(2, "the second")?;
            if c.eat(b".,").is_some() {
                let start = c.at;
                while c.eat(b"0123456789").is_some() {}
                let frac = &s[start..c.at];
                if frac.is_empty() {
                    return Err("no digits after the decimal point".into());
                }
                let ms: String = frac.chars().chain("000".chars()).take(3).collect();
                millis = ms.parse::<i64>().map_err(|e| e.to_string())?;
            }
        }
        if hour > 23 || minute > 59 || second > 60 {
            return Err(format!("{hour:02}:{minute:02}:{second:02} is not a time of day"));
        }
        // A leap second (:60) is read as the last millisecond of its minute.
        if second == 60 {
            second = 59;
            millis = 999;
        }
        if let Some(sign) = c.eat(b"Zz+-")
            && (sign == b'+' || sign == b'-')
        {
            let h = c.number(2, "the offset hours")?;
            c.eat(b":");
            let m = c.number(2, "the offset minutes")?;
            if h > 23 || m > 59 {
                return Err(format!("offset {h:02}:{m:02} is out of range"));
            }
            offset_minutes = (h * 60 + m) * if sign == b'-' { -1 } else { 1 };
        }
    }
    if !c.done() {
        return Err(format!("unexpected {:?} at the end", &s[c.at..]));
    }
    let days = days_from_civil(year, month, day);
    let seconds = days * 86_400 + hour * 3600 + minute * 60 + second - offset_minutes * 60;
    Ok(seconds * 1000 + millis)
}

fn is_leap(year: i64) -> bool {
    (year % 4 == 0 && year % 100 != 0) || year % 400 == 0
}

fn days_in_month(year: i64, month: i64) -> i64 {
    match month {
        4 | 6 | 9 | 11 => 30,
        2 if is_leap(year) => 29,
        2 => 28,
        _ => 31,
    }
}

/// Days from 1970-01-01 to a proleptic Gregorian date, in closed form:
/// leap days of the years before, plus the days of the months before
/// (counted from March, so that February's leap day ends a year).
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    // Count from 0000-03-01 so the leap day falls at the end of a year.
    let (y, m) = if month <= 2 { (year - 1, month + 9) } else { (year, month - 3) };
    let era_days = y * 365 + y.div_euclid(4) - y.div_euclid(100) + y.div_euclid(400);
    let month_days = (153 * m + 2) / 5;
    // 719_468 is the day number of 1970-01-01 counted the same way.
    era_days + month_days + day - 1 - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_accepted_forms() {
        let cases = [
            ("0", 0),
            ("1700000000000", 1_700_000_000_000),
            ("-5", -5),
            ("1970-01-01", 0),
            ("1970-01-01T00:00:00Z", 0),
            ("2013-01-01T10:00:00Z", 1_357_034_400_000),
            ("2013-01-01 10:00:00", 1_357_034_400_000),
            ("2013-01-01 10:00", 1_357_034_400_000),
            ("2013-01-01T05:00:00-05:00", 1_357_034_400_000),
            ("2013-01-01T15:30:00+0530", 1_357_034_400_000),
            ("2013-01-01t10:00:00.5z", 1_357_034_400_500),
            ("2013-01-01T10:00:00.123456789Z", 1_357_034_400_123),
            ("2000-02-29T00:00:00Z", 951_782_400_000),
            ("2024-12-31T23:59:59Z", 1_735_689_599_000),
            ("1969-12-31T23:59:59Z", -1000),
            ("2016-12-31T23:59:60Z", 1_483_228_799_999),
        ];
        for (text, want) in cases {
            assert_eq!(parse_timestamp_ms(text), Ok(want), "{text}");
        }
    }

    #[test]
    fn rejects_what_is_not_a_time() {
        for bad in [
            "",
            "NA",
            "2013-13-01",
            "2013-02-29",
            "2013-01-01T24:00:00Z",
            "2013-01-01T10:00:00 UTC",
            "2013-01-01T10",
            "13-01-01",
            "2013-01-01T10:00:00.Z",
            "99999999999999999999",
        ] {
            assert!(parse_timestamp_ms(bad).is_err(), "{bad:?} should not parse");
        }
    }

    #[test]
    fn days_match_a_day_by_day_count() {
        let mut expected = 0;
        for year in 1970..2100 {
            for month in 1..=12 {
                assert_eq!(days_from_civil(year, month, 1), expected, "{year}-{month}");
                expected += days_in_month(year, month);
            }
        }
    }
}
