//! Boot data templates: a class's `userData` rendered per machine.
//!
//! A template is plain text with Go-template-style variables, `{{ .MachineName }}` (spaces
//! inside the braces optional). Only a `{{` followed by a `.` is a variable: any other `{{ … }}`
//! (cloud-init's Jinja, say) is text and stays as it is. A variable that is not one of
//! [`Variable::ALL`], or a `{{ .` never closed by `}}`, is an error naming it. A template without
//! variables renders to itself.

use std::fmt;

/// A variable a boot data template may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Variable {
    /// The Machine's name (empty for a pool, whose instances the cloud names).
    MachineName,
    /// The Machine's (or pool's) namespace.
    MachineNamespace,
    /// The target cluster's API server, `https://host:port`.
    ApiServerUrl,
    /// The target cluster's API server as `kubeadm join` takes it, `host:port`.
    ApiServerHost,
    /// The target cluster's CA certificate, PEM.
    CaCertificate,
    /// The same, base64 (a kubeconfig's `certificate-authority-data`).
    CaCertificateBase64,
    /// `sha256:` and the hex SHA-256 of the CA's public key (its DER SubjectPublicKeyInfo), as
    /// `kubeadm join --discovery-token-ca-cert-hash` takes it.
    CaCertHash,
    /// A bootstrap token minted for this machine (or pool): `<id>.<secret>`. Using it is what
    /// makes the controller mint one.
    BootstrapToken,
    /// The labels the Node registers with, as kubelet `--node-labels` takes them (`k=v,k2=v2`):
    /// those of the node template a kubelet may set on itself.
    NodeLabels,
    /// The taints the Node registers with, as kubelet `--register-with-taints` takes them
    /// (`key=value:Effect,…`).
    NodeTaints,
}

impl Variable {
    /// Every variable, in the order the docs list them.
    pub const ALL: [Variable; 10] = [
        Variable::MachineName,
        Variable::MachineNamespace,
        Variable::ApiServerUrl,
        Variable::ApiServerHost,
        Variable::CaCertificate,
        Variable::CaCertificateBase64,
        Variable::CaCertHash,
        Variable::BootstrapToken,
        Variable::NodeLabels,
        Variable::NodeTaints,
    ];

    /// Its name in a template (without the dot).
    pub fn name(self) -> &'static str {
        match self {
            Variable::MachineName => "MachineName",
            Variable::MachineNamespace => "MachineNamespace",
            Variable::ApiServerUrl => "APIServerURL",
            Variable::ApiServerHost => "APIServerHost",
            Variable::CaCertificate => "CACertificate",
            Variable::CaCertificateBase64 => "CACertificateBase64",
            Variable::CaCertHash => "CACertHash",
            Variable::BootstrapToken => "BootstrapToken",
            Variable::NodeLabels => "NodeLabels",
            Variable::NodeTaints => "NodeTaints",
        }
    }

    fn from_name(name: &str) -> Option<Variable> {
        Variable::ALL.into_iter().find(|v| v.name() == name)
    }
}

impl fmt::Display for Variable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, ".{}", self.name())
    }
}

/// Why a template does not parse.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TemplateError {
    /// `{{ .Name }}` with a name that is not a [`Variable`].
    UnknownVariable {
        /// The name, as written.
        name: String,
        /// Its line (from 1).
        line: usize,
    },
    /// A `{{ .` with no `}}` after the name.
    Unclosed {
        /// Its line (from 1).
        line: usize,
    },
}

impl fmt::Display for TemplateError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TemplateError::UnknownVariable { name, line } => {
                write!(f, "line {line}: unknown variable {{{{ .{name} }}}} (known: {})", known())
            }
            TemplateError::Unclosed { line } => write!(f, "line {line}: a {{{{ . is not closed by }}}}"),
        }
    }
}

impl std::error::Error for TemplateError {}

/// The known variables, for messages: `.MachineName, .MachineNamespace, …`.
pub fn known() -> String {
    Variable::ALL.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Piece<'a> {
    Text(&'a str),
    Var(Variable),
}

/// A parsed template.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Template<'a> {
    pieces: Vec<Piece<'a>>,
}

impl<'a> Template<'a> {
    /// Parses `text`.
    ///
    /// # Errors
    /// The first unknown variable or unclosed `{{ .`.
    pub fn parse(text: &'a str) -> Result<Template<'a>, TemplateError> {
        let mut pieces = Vec::new();
        let mut rest = text;
        let mut consumed = 0;
        while let Some(open) = rest.find("{{") {
            let after = &rest[open + 2..];
            let inner = after.trim_start_matches([' ', '\t']);
            if !inner.starts_with('.') {
                // Not a variable: its first `{` is text (the second may open one: `{{{ .X }}`).
                pieces.push(Piece::Text(&rest[..open + 1]));
                consumed += open + 1;
                rest = &rest[open + 1..];
                continue;
            }
            let line = text[..consumed + open].matches('\n').count() + 1;
            let name_len =
                inner[1..].find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(inner.len() - 1);
            let name = &inner[1..1 + name_len];
            let tail = inner[1 + name_len..].trim_start_matches([' ', '\t']);
            if !tail.starts_with("}}") {
                return Err(TemplateError::Unclosed { line });
            }
            let var = Variable::from_name(name)
                .ok_or_else(|| TemplateError::UnknownVariable { name: name.to_string(), line })?;
            if open > 0 {
                pieces.push(Piece::Text(&rest[..open]));
            }
            pieces.push(Piece::Var(var));
            let used = rest.len() - tail.len() + 2;
            consumed += used;
            rest = &rest[used..];
        }
        if !rest.is_empty() {
            pieces.push(Piece::Text(rest));
        }
        Ok(Template { pieces })
    }

    /// The variables it uses, each once, in [`Variable::ALL`] order.
    pub fn variables(&self) -> Vec<Variable> {
        let mut out: Vec<Variable> = self
            .pieces
            .iter()
            .filter_map(|p| match p {
                Piece::Var(v) => Some(*v),
                Piece::Text(_) => None,
            })
            .collect();
        out.sort();
        out.dedup();
        out
    }

    /// Whether it uses `v`.
    pub fn uses(&self, v: Variable) -> bool {
        self.pieces.contains(&Piece::Var(v))
    }

    /// The text with every variable replaced by `value(variable)`.
    ///
    /// # Errors
    /// The first variable `value` has no value for (nothing half-rendered is returned).
    pub fn render<E>(&self, mut value: impl FnMut(Variable) -> Result<String, E>) -> Result<String, E> {
        let mut out = String::new();
        for p in &self.pieces {
            match p {
                Piece::Text(t) => out.push_str(t),
                Piece::Var(v) => out.push_str(&value(*v)?),
            }
        }
        Ok(out)
    }
}

/// The CEL rule the CRD carries for a template field (`self` the string): every `{{ .` names a
/// known variable and is closed — the same as [`Template::parse`] succeeding.
pub fn cel_rule() -> String {
    // One `matches` (a `findAll` over a 64 KiB string costs far more than the API server allows).
    format!("!self.matches('{}')", invalid_pattern().replace('\\', "\\\\"))
}

/// An RE2 pattern found in a template exactly when [`Template::parse`] refuses it: a `{{ .`
/// whose name is not known or which is not closed by `}}`. Built from the trie of the names:
/// after each prefix, whatever cannot continue to a known name and its closing is a match.
pub fn invalid_pattern() -> String {
    let names: Vec<&str> = Variable::ALL.iter().map(|v| v.name()).collect();
    format!("\\{{\\{{[ \\t]*\\.{}", after_prefix("", &names))
}

/// The alternatives that make a template invalid after the name's first characters `prefix`.
fn after_prefix(prefix: &str, names: &[&str]) -> String {
    let mut next: Vec<char> =
        names.iter().filter_map(|n| n.strip_prefix(prefix)).filter_map(|rest| rest.chars().next()).collect();
    next.sort_unstable();
    next.dedup();
    let children: String = next.iter().collect();
    let mut alternatives = vec!["$".to_string()];
    if names.contains(&prefix) {
        // The name may end here: then only `[ \t]*}}` may follow.
        alternatives.push(format!("[^{children} \\t}}]"));
        alternatives.push("\\}(?:$|[^}])".to_string());
        alternatives.push("[ \\t]+(?:$|[^ \\t}]|\\}(?:$|[^}]))".to_string());
    } else if children.is_empty() {
        alternatives.push(".".to_string());
    } else {
        // Not a name: it must go on with one.
        alternatives.push(format!("[^{children}]"));
    }
    for c in next {
        alternatives.push(format!("{c}{}", after_prefix(&format!("{prefix}{c}"), names)));
    }
    format!("(?:{})", alternatives.join("|"))
}

/// The message of the rule and of `apply`'s check.
pub const RULE_MESSAGE: &str = "a {{ .Variable }} is unknown or not closed by }} (known: .MachineName, \
     .MachineNamespace, .APIServerURL, .APIServerHost, .CACertificate, .CACertificateBase64, .CACertHash, \
     .BootstrapToken, .NodeLabels, .NodeTaints)";

/// A CA certificate (DER) as PEM.
pub fn pem(der: &[u8]) -> String {
    use base64::Engine;
    let b64 = base64::engine::general_purpose::STANDARD.encode(der);
    let mut out = String::from("-----BEGIN CERTIFICATE-----\n");
    for chunk in b64.as_bytes().chunks(64) {
        out.push_str(std::str::from_utf8(chunk).unwrap_or_default());
        out.push('\n');
    }
    out.push_str("-----END CERTIFICATE-----\n");
    out
}

/// `sha256:<hex>` of a certificate's SubjectPublicKeyInfo (DER), as `kubeadm join
/// --discovery-token-ca-cert-hash` takes it.
///
/// # Errors
/// The DER is not an X.509 certificate.
pub fn ca_cert_hash(der: &[u8]) -> Result<String, String> {
    use sha2::Digest;
    let spki = subject_public_key_info(der).ok_or("the CA is not a DER X.509 certificate")?;
    let digest = sha2::Sha256::digest(spki);
    Ok(format!("sha256:{}", digest.iter().map(|b| format!("{b:02x}")).collect::<String>()))
}

/// One DER element at the start of some bytes: (tag, whole element, contents, rest).
type Tlv<'a> = (u8, &'a [u8], &'a [u8], &'a [u8]);

/// The DER element at the start of `b`.
fn tlv(b: &[u8]) -> Option<Tlv<'_>> {
    let (&tag, rest) = b.split_first()?;
    let (&first, rest) = rest.split_first()?;
    let (len, rest) = if first < 0x80 {
        (usize::from(first), rest)
    } else {
        let n = usize::from(first & 0x7f);
        if n == 0 || n > 4 || rest.len() < n {
            return None;
        }
        (rest[..n].iter().fold(0usize, |acc, &x| (acc << 8) | usize::from(x)), &rest[n..])
    };
    if rest.len() < len {
        return None;
    }
    let header = b.len() - rest.len();
    Some((tag, &b[..header + len], &rest[..len], &rest[len..]))
}

/// The SubjectPublicKeyInfo element of a certificate: the seventh field of tbsCertificate when
/// it has an explicit version, the sixth otherwise.
fn subject_public_key_info(der: &[u8]) -> Option<&[u8]> {
    const SEQUENCE: u8 = 0x30;
    let (tag, _, cert, _) = tlv(der)?;
    let (tbs_tag, _, tbs, _) = tlv(cert)?;
    if tag != SEQUENCE || tbs_tag != SEQUENCE {
        return None;
    }
    let mut rest = tbs;
    let (tag, _, _, after) = tlv(rest)?;
    if tag == 0xa0 {
        rest = after;
    }
    // serialNumber, signature, issuer, validity, subject.
    for _ in 0..5 {
        rest = tlv(rest)?.3;
    }
    let (tag, whole, _, _) = tlv(rest)?;
    (tag == SEQUENCE).then_some(whole)
}

/// Whether a kubelet may register its Node with the label `key` under the NodeRestriction
/// admission plugin (the rest are the controller's to set once the Node joined): any key outside
/// the `kubernetes.io` and `k8s.io` domains, and in them only the well-known ones.
pub fn kubelet_may_set_label(key: &str) -> bool {
    let Some((prefix, name)) = key.split_once('/') else { return true };
    let kube = |d: &str| prefix == d || prefix.ends_with(&format!(".{d}"));
    if !kube("kubernetes.io") && !kube("k8s.io") {
        return true;
    }
    if prefix == "node-restriction.kubernetes.io" || prefix.ends_with(".node-restriction.kubernetes.io") {
        return false;
    }
    matches!(prefix, "kubelet.kubernetes.io" | "node.kubernetes.io")
        || prefix.ends_with(".kubelet.kubernetes.io")
        || prefix.ends_with(".node.kubernetes.io")
        || matches!(
            (prefix, name),
            ("kubernetes.io", "hostname" | "arch" | "os")
                | ("beta.kubernetes.io", "arch" | "os" | "instance-type")
                | ("failure-domain.beta.kubernetes.io", "region" | "zone")
                | ("topology.kubernetes.io", "region" | "zone")
        )
}

/// `--node-labels` of a node template's labels: those a kubelet may set ([`kubelet_may_set_label`]).
pub fn node_labels_flag(labels: &std::collections::BTreeMap<String, String>) -> String {
    labels
        .iter()
        .filter(|(k, _)| kubelet_may_set_label(k))
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}

/// `--register-with-taints` of a node template's taints: `key=value:Effect` (`key:Effect` without
/// a value).
pub fn node_taints_flag(taints: &[super::template::NodeTaint]) -> String {
    taints
        .iter()
        .map(|t| {
            if t.value.is_empty() {
                format!("{}:{}", t.key, t.effect)
            } else {
                format!("{}={}:{}", t.key, t.value, t.effect)
            }
        })
        .collect::<Vec<_>>()
        .join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(t: &str) -> Result<String, TemplateError> {
        Template::parse(t).map(|t| t.render(|v| Ok::<_, ()>(format!("<{}>", v.name()))).unwrap())
    }

    #[test]
    fn variables_render_and_other_braces_stay() {
        assert_eq!(render("a {{ .MachineName }} b {{.BootstrapToken}}").unwrap(), "a <MachineName> b <BootstrapToken>");
        assert_eq!(render("{{ v1.local_hostname }} {{.NodeLabels}}").unwrap(), "{{ v1.local_hostname }} <NodeLabels>");
        assert_eq!(render("no variables at all\n").unwrap(), "no variables at all\n");
        assert_eq!(render("").unwrap(), "");
        assert_eq!(render("{{").unwrap(), "{{");
        assert_eq!(render("{{{{ .MachineName }}}}").unwrap(), "{{<MachineName>}}");
        assert!(Template::parse("{{{ .Nope }}").is_err());
        let t = Template::parse("{{ .NodeTaints }}{{ .MachineName }}{{ .MachineName }}").unwrap();
        assert_eq!(t.variables(), vec![Variable::MachineName, Variable::NodeTaints]);
        assert!(t.uses(Variable::NodeTaints) && !t.uses(Variable::BootstrapToken));
    }

    #[test]
    fn unknown_and_unclosed_variables_are_refused_with_their_line() {
        assert_eq!(
            Template::parse("x\ny {{ .Token }}").unwrap_err(),
            TemplateError::UnknownVariable { name: "Token".into(), line: 2 }
        );
        assert_eq!(Template::parse("{{ .MachineName").unwrap_err(), TemplateError::Unclosed { line: 1 });
        assert_eq!(Template::parse("{{ .Machine-Name }}").unwrap_err(), TemplateError::Unclosed { line: 1 });
        assert_eq!(
            Template::parse("{{ . }}").unwrap_err(),
            TemplateError::UnknownVariable { name: String::new(), line: 1 }
        );
        let msg = Template::parse("{{ .Nope }}").unwrap_err().to_string();
        assert!(msg.contains(".Nope") && msg.contains(".BootstrapToken"), "{msg}");
    }

    #[test]
    fn a_failed_render_returns_nothing() {
        let t = Template::parse("a {{ .BootstrapToken }}").unwrap();
        assert_eq!(t.render(|_| Err::<String, _>("no token")), Err("no token"));
    }

    #[test]
    fn the_ca_hash_is_kubeadms() {
        use base64::Engine;
        // openssl req -x509 -newkey ec …; the hash from `openssl x509 -pubkey | openssl pkey
        // -pubin -outform der | sha256sum`, as kubeadm's docs compute it.
        let der = base64::engine::general_purpose::STANDARD.decode("MIIBeTCCAR+gAwIBAgIUPIyDT6IGUVgMMbwC+iKuBC0zN00wCgYIKoZIzj0EAwIwEjEQMA4GA1UEAwwHdGVzdC1jYTAeFw0yNjEyMDIyMjUyNTlaFw0zNjExMjkyMjUyNTlaMBIxEDAOBgNVBAMMB3Rlc3QtY2EwWTATBgcqhkjOPQIBBggqhkjOPQMBBwNCAAQSrBPFZ1FtCGoAch70rIz/M6mlrJg2UeK3VirpY0xf1h3Fv1E+Ax8rRviuMqJORfSuDAn4LmbOwXhJ5hUVKXiIo1MwUTAdBgNVHQ4EFgQUL7ciTolBv9uUkfGcFMZporg6e8QwHwYDVR0jBBgwFoAUL7ciTolBv9uUkfGcFMZporg6e8QwDwYDVR0TAQH/BAUwAwEB/zAKBggqhkjOPQQDAgNIADBFAiEA7aH/2VPL0jWzkbFN+A1/giBz2ehO/x3monKL0hvB7hoCICK4fjiY61ZPWqak+9QLG0YJ9A73e96HA/kzgYhzYsV1").unwrap();
        assert_eq!(
            ca_cert_hash(&der).unwrap(),
            "sha256:9e96e3f7a78021e8ef270457204ebfb6fd8d4167a7bc65c9228e2104d642b1ad"
        );
        assert!(pem(&der).starts_with("-----BEGIN CERTIFICATE-----\nMIIBeTCC"));
        assert!(ca_cert_hash(b"not a certificate").is_err());
        assert!(ca_cert_hash(&der[..40]).is_err());
    }

    #[test]
    fn kubelets_register_only_the_labels_node_restriction_allows() {
        for ok in
            ["role", "example.com/gpu", "node.kubernetes.io/pool", "topology.kubernetes.io/zone", "kubernetes.io/os"]
        {
            assert!(kubelet_may_set_label(ok), "{ok}");
        }
        for no in
            ["node-restriction.kubernetes.io/x", "node-role.kubernetes.io/worker", "kubernetes.io/role", "x.k8s.io/y"]
        {
            assert!(!kubelet_may_set_label(no), "{no}");
        }
        let labels = [("role".to_string(), "web".to_string()), ("node-role.kubernetes.io/web".into(), String::new())];
        assert_eq!(node_labels_flag(&labels.into_iter().collect()), "role=web");
        let taints = [
            super::super::template::NodeTaint {
                key: "a".into(),
                value: "b".into(),
                effect: super::super::template::TaintEffect::NoSchedule,
            },
            super::super::template::NodeTaint {
                key: "c".into(),
                value: String::new(),
                effect: super::super::template::TaintEffect::NoExecute,
            },
        ];
        assert_eq!(node_taints_flag(&taints), "a=b:NoSchedule,c:NoExecute");
    }

    #[test]
    fn the_cel_pattern_refuses_exactly_what_the_parser_refuses() {
        let re = regex::Regex::new(&invalid_pattern()).unwrap();
        let mut cases: Vec<String> = [
            "",
            "{{",
            "{{ .MachineName }}",
            "{{.MachineName}}",
            "{{ .MachineName }",
            "{{ .MachineName",
            "{{ .Machine }}",
            "{{ .MachineNamespace }}",
            "{{ .MachineNamespaces }}",
            "{{ .MachineNam }}",
            "{{ . }}",
            "{{ .}}",
            "{{{ .X }}",
            "{{ v1.x }}",
            "{{ .Ma chine}}",
            "{{ .MachineName x}}",
            "{{ .MachineName\n}}",
            "{{ .MachineName\t}}",
            "a {{ .NodeLabels }} b {{ .Nope }}",
            "{{ .CACertificateBase64 }}{{ .CACertHash }}",
            "{{ .CA }}",
            "{{\t.BootstrapToken\t}}",
            "}} {{ . {{ .NodeTaints }}",
            "{{ .NodeTaints}}}",
            "{{ .APIServerURL2 }}",
        ]
        .iter()
        .map(ToString::to_string)
        .collect();
        // And every short string over the characters that matter, alone and after `{{ .`.
        let alphabet = ['{', '}', ' ', '.', 'C', 'A', 'x', '\n'];
        let mut frontier = vec![String::new()];
        for _ in 0..5 {
            frontier = frontier.iter().flat_map(|s| alphabet.iter().map(move |c| format!("{s}{c}"))).collect();
            cases.extend(frontier.iter().map(|s| format!("{{{{ .{s}")));
            cases.extend(frontier.iter().cloned());
        }
        for v in Variable::ALL {
            for tail in ["}}", " }}", "}", "x}}", " x }}", "", "\n", "}}{{ .", " }}}"] {
                cases.push(format!("{{{{ .{}{tail}", v.name()));
                cases.push(format!("{{{{ .{}{tail}", &v.name()[..v.name().len() - 1]));
            }
        }
        for case in &cases {
            assert_eq!(re.is_match(case), Template::parse(case).is_err(), "{case:?}");
        }
    }

    #[test]
    fn the_message_lists_every_variable() {
        for v in Variable::ALL {
            assert!(RULE_MESSAGE.contains(&v.to_string()), "{v}");
        }
    }
}
