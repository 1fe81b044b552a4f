//! Answer extraction from completions: `\boxed{}` (balanced braces, nested), `<answer>`
//! tags, the last number.

/// Every `\boxed{...}` (or `\fbox{...}`) in order, with nested braces kept whole. An
/// unterminated box is ignored.
pub fn boxed_all(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(at) = ["\\boxed", "\\fbox"]
        .iter()
        .filter_map(|m| rest.find(m).map(|i| (i, m.len())))
        .min()
    {
        let after = &rest[at.0 + at.1..];
        let after_ws = after.trim_start();
        if let Some(body) = after_ws.strip_prefix('{') {
            let mut depth = 1usize;
            let mut end = None;
            for (i, c) in body.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' => {
                        depth -= 1;
                        if depth == 0 {
                            end = Some(i);
                            break;
                        }
                    }
                    _ => {}
                }
            }
            match end {
                Some(e) => {
                    out.push(body[..e].trim().to_string());
                    rest = &body[e + 1..];
                }
                None => break,
            }
        } else {
            rest = after;
        }
    }
    out
}

/// The last `\boxed{}` answer.
pub fn boxed(text: &str) -> Option<String> {
    boxed_all(text).pop()
}

/// The content of the last `<answer>...</answer>`.
pub fn answer_tag(text: &str) -> Option<String> {
    let end = text.rfind("</answer>")?;
    let start = text[..end].rfind("<answer>")? + "<answer>".len();
    Some(text[start..end].trim().to_string())
}

/// The last number in the text: optional sign (ASCII or unicode minus), digits with
/// optional thousands commas, optional decimals, or a fraction `a/b`.
pub fn last_number(text: &str) -> Option<String> {
    let chars: Vec<char> = text.chars().collect();
    let mut best: Option<String> = None;
    let mut i = 0;
    while i < chars.len() {
        if chars[i].is_ascii_digit() {
            let start = i;
            let neg = start > 0 && matches!(chars[start - 1], '-' | '−');
            while i < chars.len()
                && (chars[i].is_ascii_digit()
                    || ((chars[i] == ',' || chars[i] == '.' || chars[i] == '/')
                        && i + 1 < chars.len()
                        && chars[i + 1].is_ascii_digit()))
            {
                i += 1;
            }
            let s: String = chars[start..i].iter().filter(|c| **c != ',').collect();
            best = Some(if neg { format!("-{s}") } else { s });
        } else {
            i += 1;
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn boxed_handles_nesting_several_and_garbage() {
        assert_eq!(boxed(r"so \boxed{\frac{1}{2}}."), Some(r"\frac{1}{2}".into()));
        assert_eq!(
            boxed_all(r"\boxed{3} then \boxed{ 4 } and \fbox{5}"),
            vec!["3", "4", "5"]
        );
        assert_eq!(
            boxed(r"\boxed{\sqrt{\frac{a}{b}}} x"),
            Some(r"\sqrt{\frac{a}{b}}".into())
        );
        assert_eq!(boxed(r"\boxed{unterminated"), None);
        assert_eq!(boxed(r"\boxed{1} \boxed{2"), Some("1".into()));
        assert_eq!(boxed("no box"), None);
        assert_eq!(boxed(r"\boxed 7"), None);
        assert_eq!(boxed(r"\boxed{}"), Some(String::new()));
    }

    #[test]
    fn answer_tags_and_numbers() {
        assert_eq!(
            answer_tag("<answer>1</answer> x <answer> 42 </answer>"),
            Some("42".into())
        );
        assert_eq!(answer_tag("<answer>open"), None);
        assert_eq!(last_number("it is 1,234,567.5 dollars"), Some("1234567.5".into()));
        assert_eq!(last_number("x = −17"), Some("-17".into()));
        assert_eq!(last_number("a 3/4 slice, then -2."), Some("-2".into()));
        assert_eq!(last_number("ratio 3/4"), Some("3/4".into()));
        assert_eq!(last_number("none"), None);
        let huge = "9".repeat(400);
        assert_eq!(last_number(&format!("n = {huge}")), Some(huge));
    }
}
