//! Answer equivalence for math: integers (any size), decimals, fractions, percentages,
//! and simple LaTeX (`\frac`, `\dfrac`, `\sqrt`, `^`, `\cdot`, `\pi`), with tolerance.

/// A parsed answer value.
#[derive(Debug, Clone, PartialEq)]
pub struct Value {
    /// Numeric value.
    pub x: f64,
    /// Written as a percentage.
    pub percent: bool,
}

/// Canonical text form: LaTeX spacing, `$`, `\left/\right`, units in `\text{}`, degree
/// signs and trailing periods removed; unicode minus and `\dfrac`/`\tfrac` unified.
pub fn normalize(s: &str) -> String {
    let mut t = s.trim().to_string();
    for (a, b) in [
        ("\\dfrac", "\\frac"),
        ("\\tfrac", "\\frac"),
        ("\\left", ""),
        ("\\right", ""),
        ("\\cdot", "*"),
        ("\\times", "*"),
        ("\\div", "/"),
        ("−", "-"),
        ("\\!", ""),
        ("\\,", ""),
        ("\\;", ""),
        ("\\ ", ""),
        ("$", ""),
        ("^{\\circ}", ""),
        ("^\\circ", ""),
        ("°", ""),
        ("\\%", "%"),
    ] {
        t = t.replace(a, b);
    }
    // Units and words in \text{...} / \mbox{...} carry no value.
    for cmd in ["\\text", "\\mbox", "\\mathrm"] {
        while let Some(i) = t.find(cmd) {
            let rest = &t[i + cmd.len()..];
            match (rest.starts_with('{'), rest.find('}')) {
                (true, Some(j)) => {
                    let inner = rest[1..j].trim().to_string();
                    let keep = if inner.chars().all(|c| c.is_ascii_digit() || c == '.') {
                        inner
                    } else {
                        String::new()
                    };
                    t = format!("{}{}{}", &t[..i], keep, &rest[j + 1..]);
                }
                _ => break,
            }
        }
    }
    t.retain(|c| !c.is_whitespace());
    while t.ends_with('.') {
        t.pop();
    }
    // Thousands separators, only where the whole answer is one comma-grouped number.
    let digits_groups = {
        let body = t.strip_prefix('-').unwrap_or(&t);
        let int = body.split('.').next().unwrap_or("");
        let groups: Vec<&str> = int.split(',').collect();
        groups.len() > 1
            && (1..=3).contains(&groups[0].len())
            && groups.iter().all(|g| g.chars().all(|c| c.is_ascii_digit()))
            && groups[1..].iter().all(|g| g.len() == 3)
    };
    if digits_groups {
        t.retain(|c| c != ',');
    }
    t
}

struct P<'a> {
    s: &'a [u8],
    i: usize,
}

impl P<'_> {
    fn peek(&self) -> Option<u8> {
        self.s.get(self.i).copied()
    }
    fn eat(&mut self, c: u8) -> bool {
        if self.peek() == Some(c) {
            self.i += 1;
            true
        } else {
            false
        }
    }
    fn eat_str(&mut self, w: &str) -> bool {
        if self.s[self.i..].starts_with(w.as_bytes()) {
            self.i += w.len();
            true
        } else {
            false
        }
    }
    fn expr(&mut self, depth: usize) -> Option<f64> {
        if depth > 64 {
            return None;
        }
        let mut v = self.term(depth + 1)?;
        loop {
            if self.eat(b'+') {
                v += self.term(depth + 1)?;
            } else if self.eat(b'-') {
                v -= self.term(depth + 1)?;
            } else {
                return Some(v);
            }
        }
    }
    fn term(&mut self, depth: usize) -> Option<f64> {
        let mut v = self.factor(depth + 1)?;
        loop {
            if self.eat(b'*') {
                v *= self.factor(depth + 1)?;
            } else if self.eat(b'/') {
                v /= self.factor(depth + 1)?;
            } else if matches!(self.peek(), Some(b'(' | b'\\' | b'{'))
                || self.peek().is_some_and(|c| c.is_ascii_digit())
            {
                // Implicit multiplication: 2\sqrt{3}, 3(4), 2\pi.
                v *= self.factor(depth + 1)?;
            } else {
                return Some(v);
            }
        }
    }
    fn factor(&mut self, depth: usize) -> Option<f64> {
        if depth > 64 {
            return None;
        }
        if self.eat(b'-') {
            return Some(-self.factor(depth + 1)?);
        }
        if self.eat(b'+') {
            return self.factor(depth + 1);
        }
        let base = self.atom(depth + 1)?;
        if self.eat(b'^') {
            let e = self.atom(depth + 1)?;
            return Some(base.powf(e));
        }
        Some(base)
    }
    /// A LaTeX argument: `{...}`, or a single digit (`\frac12` is 1/2), or an atom.
    fn group(&mut self, depth: usize) -> Option<f64> {
        if self.eat(b'{') {
            let v = self.expr(depth + 1)?;
            return self.eat(b'}').then_some(v);
        }
        if let Some(c) = self.peek().filter(u8::is_ascii_digit) {
            self.i += 1;
            return Some((c - b'0') as f64);
        }
        self.atom(depth + 1)
    }
    fn atom(&mut self, depth: usize) -> Option<f64> {
        if depth > 64 {
            return None;
        }
        match self.peek()? {
            b'(' => {
                self.i += 1;
                let v = self.expr(depth + 1)?;
                self.eat(b')').then_some(v)
            }
            b'{' => self.group(depth + 1),
            b'\\' => {
                if self.eat_str("\\frac") {
                    let a = self.group(depth + 1)?;
                    let b = self.group(depth + 1)?;
                    Some(a / b)
                } else if self.eat_str("\\sqrt") {
                    if self.eat(b'[') {
                        let n = self.expr(depth + 1)?;
                        if !self.eat(b']') {
                            return None;
                        }
                        Some(self.group(depth + 1)?.powf(1.0 / n))
                    } else {
                        Some(self.group(depth + 1)?.sqrt())
                    }
                } else if self.eat_str("\\pi") {
                    Some(std::f64::consts::PI)
                } else {
                    None
                }
            }
            b'0'..=b'9' | b'.' => {
                let start = self.i;
                while self.peek().is_some_and(|c| c.is_ascii_digit() || c == b'.') {
                    self.i += 1;
                }
                std::str::from_utf8(&self.s[start..self.i]).ok()?.parse().ok()
            }
            _ => None,
        }
    }
}

/// Parses a normalized answer to a value.
pub fn value(s: &str) -> Option<Value> {
    let n = normalize(s);
    let (body, percent) = match n.strip_suffix('%') {
        Some(b) => (b.to_string(), true),
        None => (n, false),
    };
    if body.is_empty() {
        return None;
    }
    let mut p = P {
        s: body.as_bytes(),
        i: 0,
    };
    let x = p.expr(0)?;
    (p.i == body.len() && x.is_finite()).then_some(Value { x, percent })
}

fn integer_text(s: &str) -> Option<(bool, String)> {
    let (neg, digits) = match s.strip_prefix('-') {
        Some(d) => (true, d),
        None => (false, s),
    };
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let trimmed = digits.trim_start_matches('0');
    let trimmed = if trimmed.is_empty() { "0" } else { trimmed };
    Some((neg && trimmed != "0", trimmed.to_string()))
}

/// Whether `answer` means the same as `reference`, within relative tolerance `tol`.
pub fn equivalent(answer: &str, reference: &str, tol: f64) -> bool {
    let (a, b) = (normalize(answer), normalize(reference));
    if a.is_empty() || b.is_empty() {
        return false;
    }
    if a == b {
        return true;
    }
    // Integers compare exactly as text, whatever their size.
    if let (Some(x), Some(y)) = (integer_text(&a), integer_text(&b)) {
        return x == y;
    }
    match (value(&a), value(&b)) {
        (Some(x), Some(y)) => {
            let close = |p: f64, q: f64| (p - q).abs() <= tol * q.abs().max(1.0);
            close(x.x, y.x)
                || (x.percent && !y.percent && close(x.x / 100.0, y.x))
                || (y.percent && !x.percent && close(x.x, y.x / 100.0))
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equivalences() {
        let yes = [
            ("42", "42"),
            ("042", "42"),
            ("−17", "-17"),
            ("1,000", "1000"),
            ("0.5", "1/2"),
            (r"\frac{1}{2}", "0.5"),
            (r"\dfrac{3}{4}", "0.75"),
            (r"\frac12", "0.5"),
            (r"2\sqrt{2}", r"\sqrt{8}"),
            (r"\sqrt[3]{27}", "3"),
            ("2^{10}", "1024"),
            ("2^3", "8"),
            ("50%", "0.5"),
            (r"50\%", "50"),
            (r"$\left(3\right)$", "3"),
            (r"10\text{ cm}", "10"),
            ("90^\\circ", "90"),
            ("3.14159265", r"\pi"),
            ("7.", "7"),
        ];
        for (a, b) in yes {
            assert!(equivalent(a, b, 1e-6), "{a} should equal {b}");
        }
        let no = [
            ("41", "42"),
            ("0.49", "1/2"),
            ("", "0"),
            ("abc", "42"),
            (r"\frac{1}{0}", "1"),
            ("1,00", "100"),
        ];
        for (a, b) in no {
            assert!(!equivalent(a, b, 1e-6), "{a} should not equal {b}");
        }
    }

    #[test]
    fn huge_and_hostile_inputs() {
        let big = "123456789".repeat(50);
        assert!(equivalent(&big, &big, 1e-6));
        assert!(
            !equivalent(&format!("{big}1"), &format!("{big}2"), 1e-6),
            "no float rounding for huge integers"
        );
        assert!(!equivalent("1e999999", "1", 1e-6));
        let deep = format!("{}1{}", "(".repeat(10_000), ")".repeat(10_000));
        assert!(value(&deep).is_none(), "deep nesting is refused, not a stack overflow");
        assert!(!equivalent(&"{".repeat(5000), "1", 1e-6));
    }
}
