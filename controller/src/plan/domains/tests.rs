use super::*;

fn domains(weights: &[u32]) -> Vec<FailureDomain> {
    weights
        .iter()
        .enumerate()
        .map(|(i, w)| FailureDomain { name: format!("z{i}"), provider_spec: None, weight: *w })
        .collect()
}

#[test]
fn shares_split_replicas_by_weight_over_the_open_domains() {
    let d = domains(&[1, 1, 1]);
    let s = Spread::new(&d, std::iter::empty(), "r", vec![true, true, true]);
    assert_eq!(s.shares(10), [4, 3, 3]);
    let s = Spread::new(&d, std::iter::empty(), "r", vec![true, false, true]);
    assert_eq!(s.shares(9), [5, 0, 4]);
    let d = domains(&[2, 1]);
    let s = Spread::new(&d, std::iter::empty(), "r", vec![true, true]);
    assert_eq!(s.shares(7), [5, 2]);
    let s = Spread::new(&d, std::iter::empty(), "r", vec![false, false]);
    assert_eq!(s.shares(7), [0, 0]);
}

#[test]
fn place_fills_the_least_populated_open_domain() {
    let d = domains(&[1, 1, 1]);
    let mut s = Spread::new(&d, std::iter::empty(), "r", vec![true, false, true]);
    let got: Vec<String> = (0..4).filter_map(|_| s.place().map(|d| d.name.clone())).collect();
    assert_eq!(got, ["z0", "z2", "z0", "z2"]);
    let mut s = Spread::new(&d, std::iter::empty(), "r", vec![false, false, false]);
    assert!(s.place().is_none());
}

#[test]
fn backoff_doubles_up_to_the_maximum() {
    let b = FailureDomainBackoff { initial_seconds: 10, max_seconds: 35 };
    let mut st = FailureDomainStatus::default();
    let now = chrono::Utc::now();
    let got: Vec<u64> = (0..4).map(|_| mark(&mut st, &b, now, "InsufficientCapacity", "no room")).collect();
    assert_eq!(got, [10, 20, 35, 35]);
    assert_eq!(st.unavailable_until, Some(now + chrono::Duration::seconds(35)));
}
