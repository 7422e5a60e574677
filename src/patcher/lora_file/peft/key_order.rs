//! The keys of a JSON object in the order the file lists them.
//!
//! serde_json's `Value` keeps an object's keys sorted (its `preserve_order` feature would change
//! every map of every crate in a build, ours and our users', so the crate does not turn it on),
//! while PEFT's `alpha_pattern` is first-match in the file's order. This reads only that order,
//! from text `serde_json` has already parsed: a cursor over the bytes that skips whitespace,
//! strings (with their escapes) and nested values, and decodes each key with `serde_json`. One
//! pass, O(length of the text).

/// The keys of the object `field` of the top-level object of `text`, in the file's order; a key
/// listed twice keeps its first place (Python's `json` keeps the first place and the last value).
/// `Ok(None)` when there is no such field or it is not an object.
///
/// `text` must be JSON `serde_json` accepted: `Err(())` only if it is not.
pub(super) fn object_keys(text: &str, field: &str) -> Result<Option<Vec<String>>, ()> {
    let mut scan = Scan { text, at: 0 };
    let mut keys = None;
    scan.object(|key, scan| {
        if decode(key)? != field {
            return scan.skip_value();
        }
        if scan.peek() != Some(b'{') {
            keys = None;
            return scan.skip_value();
        }
        let mut found: Vec<String> = Vec::new();
        scan.object(|key, scan| {
            let key = decode(key)?;
            if !found.contains(&key) {
                found.push(key);
            }
            scan.skip_value()
        })?;
        keys = Some(found);
        Ok(())
    })?;
    Ok(keys)
}

/// A JSON string's text (quotes and escapes included) as the string it means.
fn decode(raw: &str) -> Result<String, ()> {
    serde_json::from_str(raw).map_err(|_| ())
}

struct Scan<'a> {
    text: &'a str,
    at: usize,
}

impl<'a> Scan<'a> {
    fn peek(&mut self) -> Option<u8> {
        let bytes = self.text.as_bytes();
        while bytes.get(self.at).is_some_and(u8::is_ascii_whitespace) {
            self.at += 1;
        }
        bytes.get(self.at).copied()
    }

    /// Steps over `c`, the next byte after whitespace, or fails.
    fn expect(&mut self, c: u8) -> Result<(), ()> {
        if self.peek() == Some(c) {
            self.at += 1;
            Ok(())
        } else {
            Err(())
        }
    }

    /// The next value, a string: its raw text, quotes included.
    fn string(&mut self) -> Result<&'a str, ()> {
        self.expect(b'"')?;
        let bytes = self.text.as_bytes();
        let start = self.at - 1;
        loop {
            match bytes.get(self.at).ok_or(())? {
                b'\\' => self.at += 2,
                b'"' => break,
                _ => self.at += 1,
            }
        }
        self.at += 1;
        // Both ends are ASCII quotes, so char boundaries.
        self.text.get(start..self.at).ok_or(())
    }

    /// Steps over the next value, whatever it is.
    fn skip_value(&mut self) -> Result<(), ()> {
        let bytes = self.text.as_bytes();
        match self.peek().ok_or(())? {
            b'"' => self.string().map(drop),
            b'{' | b'[' => {
                let mut depth = 0usize;
                loop {
                    match bytes.get(self.at).ok_or(())? {
                        b'"' => {
                            self.string()?;
                            continue;
                        }
                        b'{' | b'[' => depth += 1,
                        b'}' | b']' => {
                            depth -= 1;
                            if depth == 0 {
                                self.at += 1;
                                return Ok(());
                            }
                        }
                        _ => {}
                    }
                    self.at += 1;
                }
            }
            _ => {
                // A number, `true`, `false` or `null`: up to the next delimiter.
                while bytes
                    .get(self.at)
                    .is_some_and(|c| !matches!(c, b',' | b'}' | b']') && !c.is_ascii_whitespace())
                {
                    self.at += 1;
                }
                Ok(())
            }
        }
    }

    /// Steps over the next value, an object, calling `member` with each key's raw text and the
    /// cursor at its value, which `member` must step over.
    fn object(
        &mut self,
        mut member: impl FnMut(&'a str, &mut Scan<'a>) -> Result<(), ()>,
    ) -> Result<(), ()> {
        self.expect(b'{')?;
        if self.peek() == Some(b'}') {
            self.at += 1;
            return Ok(());
        }
        loop {
            let key = self.string()?;
            self.expect(b':')?;
            member(key, self)?;
            if self.peek() == Some(b',') {
                self.at += 1;
            } else {
                return self.expect(b'}');
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::object_keys;

    fn keys(text: &str) -> Option<Vec<String>> {
        serde_json::from_str::<serde_json::Value>(text).expect("the test's text is JSON");
        object_keys(text, "p").unwrap()
    }

    #[test]
    fn keys_come_in_the_files_order_not_sorted() {
        assert_eq!(
            keys(r#"{"p": {"z": 1, "a\\.b": 2, "m": 3}}"#),
            Some(vec!["z".into(), r"a\.b".into(), "m".into()])
        );
    }

    #[test]
    fn nested_values_strings_with_braces_and_other_fields_are_stepped_over() {
        let text = r#" { "a": {"p": {"x": 1}}, "s": "}\"{", "l": [1, {"p": 2}, "]"],
            "p" : { "k\"}" : [ {"y": null} ], "unicode\u00e9": -1.5e3, "t": true } , "z": false } "#;
        assert_eq!(
            keys(text),
            Some(vec!["k\"}".into(), "unicodeé".into(), "t".into()])
        );
    }

    #[test]
    fn a_repeated_key_keeps_its_first_place() {
        assert_eq!(
            keys(r#"{"p": {"b": 1, "a": 2, "b": 3}}"#),
            Some(vec!["b".into(), "a".into()])
        );
    }

    #[test]
    fn a_field_that_is_missing_or_no_object_has_no_keys() {
        assert_eq!(keys(r#"{"q": {"a": 1}}"#), None);
        assert_eq!(keys(r#"{"p": [1, 2]}"#), None);
        assert_eq!(keys(r#"{"p": {}}"#), Some(vec![]));
    }
}
