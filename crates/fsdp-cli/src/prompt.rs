//! Asking questions: arrow-key menus on a terminal, numbered lines when input is piped (so
//! scripts and tests can drive the questionnaire).

use std::io::{BufRead, Write};

use anyhow::{Context, Result, bail};

/// A way to ask the user questions.
pub trait Prompter {
    /// Picks one of `options`; returns its index.
    fn select(&mut self, question: &str, options: &[&str], default: usize) -> Result<usize>;
    /// Free text; an empty answer takes `default` when there is one.
    fn input(&mut self, question: &str, default: Option<&str>) -> Result<String>;
    /// Yes or no.
    fn confirm(&mut self, question: &str, default: bool) -> Result<bool>;
    /// Tells the user something (a rejected answer, a value chosen for them).
    fn note(&mut self, text: &str) -> Result<()>;
}

/// Menus and prompts on an interactive terminal.
pub struct TerminalPrompter;

impl Prompter for TerminalPrompter {
    fn select(&mut self, question: &str, options: &[&str], default: usize) -> Result<usize> {
        dialoguer::Select::new()
            .with_prompt(question)
            .items(options)
            .default(default)
            .interact()
            .context("reading a menu choice from the terminal")
    }

    fn input(&mut self, question: &str, default: Option<&str>) -> Result<String> {
        let mut input = dialoguer::Input::<String>::new().with_prompt(question);
        match default {
            // An empty default: Enter answers nothing (an optional setting left unset).
            Some("") => input = input.allow_empty(true),
            Some(d) => input = input.default(d.to_string()),
            None => {}
        }
        input
            .interact_text()
            .context("reading an answer from the terminal")
    }

    fn confirm(&mut self, question: &str, default: bool) -> Result<bool> {
        dialoguer::Confirm::new()
            .with_prompt(question)
            .default(default)
            .interact()
            .context("reading a yes/no answer from the terminal")
    }

    fn note(&mut self, text: &str) -> Result<()> {
        eprintln!("{text}");
        Ok(())
    }
}

/// Questions answered one line at a time: menus by number (1-based) or name, yes/no, or an
/// empty line for the default. A bad answer is explained and asked again; running out of
/// input is an error naming the question.
pub struct LinePrompter<R, W> {
    input: R,
    output: W,
}

impl<R: BufRead, W: Write> LinePrompter<R, W> {
    /// Reads answers from `input`, writes questions to `output`.
    pub fn new(input: R, output: W) -> Self {
        LinePrompter { input, output }
    }

    fn answer(&mut self, question: &str) -> Result<String> {
        self.output.flush()?;
        let mut line = String::new();
        let n = self.input.read_line(&mut line)?;
        if n == 0 {
            bail!("input ended before the question \"{question}\" was answered");
        }
        let answer = line.trim().to_string();
        writeln!(self.output, "{answer}")?;
        Ok(answer)
    }

    fn retry(&mut self, message: &str) -> Result<()> {
        self.note(&format!("  {message}"))
    }
}

impl<R: BufRead, W: Write> Prompter for LinePrompter<R, W> {
    fn select(&mut self, question: &str, options: &[&str], default: usize) -> Result<usize> {
        writeln!(self.output, "{question}")?;
        for (i, option) in options.iter().enumerate() {
            let mark = if i == default { " (default)" } else { "" };
            writeln!(self.output, "  [{}] {option}{mark}", i + 1)?;
        }
        loop {
            write!(self.output, "Please select a choice [{}]: ", default + 1)?;
            let answer = self.answer(question)?;
            if answer.is_empty() {
                return Ok(default);
            }
            if let Some(i) = fsdp::config::parse_choice_index(options, &answer) {
                return Ok(i);
            }
            self.retry(&format!(
                "please enter a number from 1 to {} or an option's name",
                options.len()
            ))?;
        }
    }

    fn input(&mut self, question: &str, default: Option<&str>) -> Result<String> {
        loop {
            match default {
                Some(d) if !d.is_empty() => write!(self.output, "{question} [{d}]: ")?,
                _ => write!(self.output, "{question}: ")?,
            }
            let answer = self.answer(question)?;
            match (answer.is_empty(), default) {
                (false, _) => return Ok(answer),
                (true, Some(d)) => return Ok(d.to_string()),
                (true, None) => self.retry("an answer is required")?,
            }
        }
    }

    fn confirm(&mut self, question: &str, default: bool) -> Result<bool> {
        let hint = if default { "YES/no" } else { "yes/NO" };
        loop {
            write!(self.output, "{question} [{hint}]: ")?;
            let answer = self.answer(question)?;
            if answer.is_empty() {
                return Ok(default);
            }
            match fsdp::config::parse_bool(&answer) {
                Ok(b) => return Ok(b),
                Err(_) => self.retry("please enter yes or no")?,
            }
        }
    }

    fn note(&mut self, text: &str) -> Result<()> {
        writeln!(self.output, "{text}")?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn line_answers_defaults_and_retries() {
        let input = b"\n3\nnope\nyes\n\nfoo\n" as &[u8];
        let mut out = Vec::new();
        let mut p = LinePrompter::new(input, &mut out);
        assert_eq!(p.select("q1", &["a", "b", "c"], 1).unwrap(), 1);
        assert_eq!(p.select("q2", &["a", "b", "c"], 0).unwrap(), 2);
        assert!(p.confirm("q3", false).unwrap());
        assert_eq!(p.input("q4", Some("dflt")).unwrap(), "dflt");
        assert_eq!(p.input("q5", None).unwrap(), "foo");
        let err = p.confirm("q6", true).unwrap_err();
        assert!(err.to_string().contains("\"q6\""), "{err}");
        let text = String::from_utf8(out).unwrap();
        assert!(text.contains("please enter yes or no"), "{text}");
    }
}
