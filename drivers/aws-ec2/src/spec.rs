//! The provider spec: its JSON schema, its typed form, and the RunInstances request built from
//! it.

use std::collections::BTreeMap;

use aws_sdk_ec2::operation::run_instances::builders::RunInstancesFluentBuilder;
use aws_sdk_ec2::types::{
    BlockDeviceMapping, EbsBlockDevice, IamInstanceProfileSpecification, InstanceInterruptionBehavior,
    InstanceMarketOptionsRequest, InstanceType, LaunchTemplateSpecification, MarketType, Placement, ResourceType,
    SpotInstanceType, SpotMarketOptions, Tag, TagSpecification, VolumeType,
};
use base64::Engine;
use driver_sdk::{reason, DriverError, Secrets, Violation};
use serde::Deserialize;
use serde_json::{json, Value};

/// A provider spec, as the schema allows it. The SDK has validated it against [`schema`] before
/// the driver sees it; [`ProviderSpec::parse`] adds the checks JSON Schema cannot express here.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ProviderSpec {
    /// Region; else the sidecar's region (flag, environment or profile).
    pub region: Option<String>,
    /// AMI ID; required unless the launch template names one.
    pub image_id: Option<String>,
    /// Instance type, e.g. `t3.micro`.
    pub instance_type: String,
    /// Availability zone (`Placement.AvailabilityZone`), e.g. `eu-west-1a`: what a failure
    /// domain sets. None: the subnet's zone, else the launch template's, else EC2 picks one.
    pub availability_zone: Option<String>,
    /// `subnet-…`; none: the launch template's, else EC2 picks the default VPC's subnet (in
    /// `availabilityZone` when given). A subnet lives in one zone: with both, they must agree.
    pub subnet_id: Option<String>,
    /// `sg-…` IDs; none: the launch template's, else the VPC's default group.
    #[serde(default)]
    pub security_group_ids: Vec<String>,
    /// EC2 key pair name.
    pub key_name: Option<String>,
    /// User data as plain text; the driver base64-encodes it. A `userData` secret (the
    /// controller's rendered boot data) takes precedence, see [`user_data`].
    pub user_data: Option<UserData>,
    /// IAM instance profile: a name, or an ARN (`arn:…`).
    pub iam_instance_profile: Option<String>,
    /// EBS block devices.
    #[serde(default)]
    pub block_devices: Vec<BlockDevice>,
    /// Extra instance tags (besides the owner labels).
    #[serde(default)]
    pub tags: BTreeMap<String, String>,
    /// Launch template to start from.
    pub launch_template: Option<LaunchTemplate>,
    /// How the capacity is bought (RunInstances' `InstanceMarketOptions`): spot, or on-demand
    /// when absent.
    pub instance_market_options: Option<InstanceMarketOptions>,
}

/// User data (a boot script, often with a bootstrap token in it): the text itself, whose `Debug`
/// prints its size only, so no log line, span field or error built with `{:?}` carries it.
#[derive(Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(transparent)]
pub struct UserData(String);

impl UserData {
    /// The text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl From<&str> for UserData {
    fn from(s: &str) -> Self {
        Self(s.to_string())
    }
}

impl std::ops::Deref for UserData {
    type Target = str;
    fn deref(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for UserData {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "UserData({} bytes)", self.0.len())
    }
}

/// The secret key holding the rendered boot data the controller sends (MachineClass
/// `spec.userData`, else its Secret's `userData`, with the variables filled in). It takes
/// precedence over the provider spec's `userData`.
pub const USER_DATA_KEY: &str = "userData";
/// EC2's limit on user data: 16 KiB of raw bytes, before base64.
pub const MAX_USER_DATA_BYTES: usize = 16384;

/// The user data of a launch: the `userData` secret when it is set (not empty), else the
/// provider spec's `userData`; none when neither is.
///
/// # Errors
/// INVALID_ARGUMENT when it is larger than EC2 takes ([`MAX_USER_DATA_BYTES`]): `FIELD_INVALID`
/// naming `secrets.userData`, or `INVALID_PROVIDER_SPEC` naming `provider_spec.userData`. The
/// message gives the size and the limit, never the content.
pub fn user_data<'a>(spec: &'a ProviderSpec, secrets: &'a Secrets) -> Result<Option<&'a str>, DriverError> {
    let (field, data) = match secrets.get(USER_DATA_KEY).filter(|d| !d.is_empty()) {
        Some(d) => ("secrets.userData", d),
        None => match spec.user_data.as_deref() {
            Some(d) => ("provider_spec.userData", d),
            None => return Ok(None),
        },
    };
    if data.len() <= MAX_USER_DATA_BYTES {
        return Ok(Some(data));
    }
    let why = format!(
        "userData is {} bytes; EC2 takes at most {MAX_USER_DATA_BYTES} bytes of user data (before base64)",
        data.len()
    );
    let reason = if field.starts_with("secrets.") { reason::FIELD_INVALID } else { reason::INVALID_PROVIDER_SPEC };
    Err(DriverError::invalid_argument(reason, format!("{field}: {why}")).with_violation(field, why))
}

/// RunInstances' `InstanceMarketOptions`, in the spec's camelCase.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct InstanceMarketOptions {
    /// `spot` (the only market type a machine can use).
    pub market_type: String,
    /// The spot request's options.
    #[serde(default)]
    pub spot_options: SpotOptions,
}

/// RunInstances' `SpotMarketOptions`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SpotOptions {
    /// Highest price per hour in USD, e.g. `"0.05"`; none: the on-demand price (AWS's default).
    pub max_price: Option<String>,
    /// `one-time` (the default, and the only one allowed: a persistent request relaunches
    /// instances on its own, behind the controller's back).
    pub spot_instance_type: Option<String>,
    /// `terminate` (the default, and the only one a one-time request allows).
    pub instance_interruption_behavior: Option<String>,
}

impl ProviderSpec {
    /// Whether the spec asks for spot capacity.
    pub fn is_spot(&self) -> bool {
        self.instance_market_options.as_ref().is_some_and(|m| m.market_type == "spot")
    }
}

/// One EBS block device.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BlockDevice {
    /// e.g. `/dev/xvda`.
    pub device_name: String,
    /// Size in GiB.
    pub volume_size: Option<i32>,
    /// gp2, gp3, io1, io2, st1, sc1, standard.
    pub volume_type: Option<String>,
    /// Provisioned IOPS.
    pub iops: Option<i32>,
    /// Throughput in MiB/s (gp3).
    pub throughput: Option<i32>,
    /// Encrypt the volume.
    pub encrypted: Option<bool>,
    /// KMS key for encryption.
    pub kms_key_id: Option<String>,
    /// Delete the volume with the instance (default true).
    pub delete_on_termination: Option<bool>,
}

/// A launch template reference.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LaunchTemplate {
    /// `lt-…`.
    pub id: Option<String>,
    /// The template's name.
    pub name: Option<String>,
    /// A version number, `$Latest` or `$Default`.
    pub version: Option<String>,
}

/// Tag keys the driver owns; they are not reported back as labels.
pub const TAG_NAME: &str = "machinedriver.dev/name";
/// Tag holding the hash of the provider spec the instance was launched from.
pub const TAG_SPEC_HASH: &str = "machinedriver.dev/spec-hash";

/// The JSON schema served in `GetDriverInfo`. Its two `examples` are valid against moto's default
/// AMIs; real accounts pass their own specs.
pub fn schema() -> Value {
    let id = |prefix: &str| json!({"type": "string", "pattern": format!("^{prefix}-[0-9a-f]{{8,17}}$")});
    json!({
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "AWS EC2 machine",
        "description": "One EC2 instance. imageId is required unless launchTemplate provides the AMI. Credentials come from the MachineClass secret, not the spec: accessKeyId + secretAccessKey (+ sessionToken), or roleArn (+ externalId, roleSessionName) assumed with STS (signed by those keys if given, else by the sidecar's chain); a secret with none of these keys means the sidecar's default AWS credential chain.",
        "type": "object",
        "additionalProperties": false,
        "required": ["instanceType"],
        "properties": {
            "region": {"type": "string", "pattern": "^[a-z]{2}(-[a-z]+)+-[0-9]+$",
                       "description": "AWS region; default: the sidecar's --region / AWS_REGION / profile"},
            "imageId": id("ami"),
            "instanceType": {"type": "string", "pattern": "^[a-z0-9-]+\\.[a-z0-9-]+$"},
            "availabilityZone": {"type": "string", "pattern": "^[a-z]{2}(-[a-z0-9]+)+$", "maxLength": 64,
                                 "description": "availability zone of the instance (Placement.AvailabilityZone), e.g. eu-west-1a: the field a failure domain sets; default: the subnet's zone, else EC2 picks one. With subnetId, the subnet must be in this zone"},
            "subnetId": id("subnet"),
            "securityGroupIds": {"type": "array", "maxItems": 16, "items": id("sg")},
            "keyName": {"type": "string", "minLength": 1, "maxLength": 255},
            "userData": {"type": "string", "maxLength": 16384,
                         "description": "plain text; the driver base64-encodes it. A userData secret (the MachineClass's rendered boot data) takes precedence. At most 16384 bytes (EC2's limit, before base64)"},
            "iamInstanceProfile": {"type": "string", "minLength": 1,
                                   "description": "instance profile name or ARN (needs iam:PassRole)"},
            "blockDevices": {"type": "array", "maxItems": 16, "items": {
                "type": "object", "additionalProperties": false, "required": ["deviceName"],
                "properties": {
                    "deviceName": {"type": "string", "pattern": "^/dev/[a-z0-9]+$"},
                    "volumeSize": {"type": "integer", "minimum": 1, "maximum": 65536},
                    "volumeType": {"type": "string", "enum": ["gp2", "gp3", "io1", "io2", "st1", "sc1", "standard"]},
                    "iops": {"type": "integer", "minimum": 100, "maximum": 256000},
                    "throughput": {"type": "integer", "minimum": 125, "maximum": 2000},
                    "encrypted": {"type": "boolean"},
                    "kmsKeyId": {"type": "string", "minLength": 1},
                    "deleteOnTermination": {"type": "boolean"}
                }
            }},
            "tags": {"type": "object", "additionalProperties": {"type": "string", "maxLength": 256}},
            "instanceMarketOptions": {
                "type": "object", "additionalProperties": false, "required": ["marketType"],
                "description": "spot capacity (RunInstances InstanceMarketOptions); absent: on-demand. A one-time request that terminates on interruption: the driver reports the interruption notice as an event",
                "properties": {
                    "marketType": {"type": "string", "enum": ["spot"]},
                    "spotOptions": {
                        "type": "object", "additionalProperties": false,
                        "properties": {
                            "maxPrice": {"type": "string", "pattern": "^[0-9]+(\\.[0-9]+)?$",
                                         "description": "highest price per hour in USD; default: the on-demand price"},
                            "spotInstanceType": {"type": "string", "enum": ["one-time"]},
                            "instanceInterruptionBehavior": {"type": "string", "enum": ["terminate"]}
                        }
                    }
                }
            },
            "launchTemplate": {
                "type": "object", "additionalProperties": false,
                "description": "exactly one of id or name; version defaults to $Default",
                "properties": {
                    "id": id("lt"),
                    "name": {"type": "string", "pattern": "^[a-zA-Z0-9().\\-/_]{3,128}$"},
                    "version": {"type": "string", "pattern": "^([0-9]+|\\$Latest|\\$Default)$"}
                }
            }
        },
        "examples": [
            {"imageId": "ami-12c6146b", "instanceType": "t3.micro",
             "tags": {"team": "platform"},
             "blockDevices": [{"deviceName": "/dev/xvda", "volumeSize": 20, "volumeType": "gp3"}]},
            {"imageId": "ami-12c6146b", "instanceType": "t3.small", "userData": "#!/bin/sh\necho hello\n"}
        ]
    })
}

impl ProviderSpec {
    /// The typed spec, with the rules the schema cannot express (imageId or launchTemplate; a
    /// launch template names exactly one of id and name).
    ///
    /// # Errors
    /// INVALID_ARGUMENT / INVALID_PROVIDER_SPEC naming each offending field.
    pub fn parse(spec: &Value) -> Result<Self, DriverError> {
        let parsed: ProviderSpec = serde_json::from_value(spec.clone()).map_err(|e| {
            DriverError::invalid_provider_spec(vec![Violation::new("provider_spec", e.to_string())]).with_source(e)
        })?;
        let mut violations = Vec::new();
        match &parsed.launch_template {
            None if parsed.image_id.is_none() => {
                violations.push(Violation::new("provider_spec.imageId", "is required unless launchTemplate is set"))
            }
            Some(lt) if lt.id.is_some() == lt.name.is_some() => {
                violations.push(Violation::new("provider_spec.launchTemplate", "set exactly one of id and name"))
            }
            _ => {}
        }
        if let (Some(az), Some(region)) = (&parsed.availability_zone, &parsed.region) {
            if !az.starts_with(region.as_str()) {
                violations.push(Violation::new(
                    "provider_spec.availabilityZone",
                    format!("{az} is not a zone of region {region}"),
                ));
            }
        }
        for (k, _) in parsed.tags.iter().filter(|(k, _)| k.starts_with("aws:") || k.starts_with("machinedriver.dev/")) {
            violations.push(Violation::new(
                format!("provider_spec.tags.{k}"),
                "the aws: and machinedriver.dev/ prefixes are reserved",
            ));
        }
        if let Some(m) = &parsed.instance_market_options {
            violations.extend(m.violations());
        }
        if !violations.is_empty() {
            return Err(DriverError::invalid_provider_spec(violations));
        }
        Ok(parsed)
    }

    /// Fills a RunInstances request for one instance. Tags are the spec's `tags`, then the owner
    /// labels, then the driver's own (name, spec hash); later ones win on equal keys. `user_data`
    /// is what [`user_data`] chose (the secret's or the spec's), sent base64-encoded.
    pub fn apply(
        &self,
        mut req: RunInstancesFluentBuilder,
        tags: &BTreeMap<String, String>,
        user_data: Option<&str>,
    ) -> RunInstancesFluentBuilder {
        req = req.min_count(1).max_count(1).instance_type(InstanceType::from(self.instance_type.as_str()));
        if let Some(v) = &self.image_id {
            req = req.image_id(v);
        }
        if let Some(v) = &self.availability_zone {
            req = req.placement(Placement::builder().availability_zone(v).build());
        }
        if let Some(v) = &self.subnet_id {
            req = req.subnet_id(v);
        }
        for sg in &self.security_group_ids {
            req = req.security_group_ids(sg);
        }
        if let Some(v) = &self.key_name {
            req = req.key_name(v);
        }
        if let Some(v) = user_data {
            req = req.user_data(base64::engine::general_purpose::STANDARD.encode(v));
        }
        if let Some(v) = &self.iam_instance_profile {
            let p = IamInstanceProfileSpecification::builder();
            let p = if v.starts_with("arn:") { p.arn(v) } else { p.name(v) };
            req = req.iam_instance_profile(p.build());
        }
        for d in &self.block_devices {
            let ebs = EbsBlockDevice::builder()
                .set_volume_size(d.volume_size)
                .set_volume_type(d.volume_type.as_deref().map(VolumeType::from))
                .set_iops(d.iops)
                .set_throughput(d.throughput)
                .set_encrypted(d.encrypted)
                .set_kms_key_id(d.kms_key_id.clone())
                .delete_on_termination(d.delete_on_termination.unwrap_or(true))
                .build();
            req = req.block_device_mappings(BlockDeviceMapping::builder().device_name(&d.device_name).ebs(ebs).build());
        }
        if let Some(m) = &self.instance_market_options {
            req = req.instance_market_options(m.to_request());
        }
        if let Some(lt) = &self.launch_template {
            req = req.launch_template(
                LaunchTemplateSpecification::builder()
                    .set_launch_template_id(lt.id.clone())
                    .set_launch_template_name(lt.name.clone())
                    .version(lt.version.clone().unwrap_or_else(|| "$Default".into()))
                    .build(),
            );
        }
        let mut spec = TagSpecification::builder().resource_type(ResourceType::Instance);
        for (k, v) in tags {
            spec = spec.tags(Tag::builder().key(k).value(v).build());
        }
        req.tag_specifications(spec.build())
    }
}

impl InstanceMarketOptions {
    /// What the schema says again, for specs that reach [`ProviderSpec::parse`] unvalidated,
    /// with a reason for each refusal.
    fn violations(&self) -> Vec<Violation> {
        let field = |f: &str| format!("provider_spec.instanceMarketOptions.{f}");
        let mut out = Vec::new();
        if self.market_type != "spot" {
            out.push(Violation::new(
                field("marketType"),
                format!("{:?} is not supported: the only market type is \"spot\" (omit instanceMarketOptions for on-demand)", self.market_type),
            ));
        }
        let o = &self.spot_options;
        if let Some(p) = &o.max_price {
            let decimal = p.split_once('.').map_or(p.as_str(), |(a, _)| a);
            let ok = !p.is_empty()
                && p.chars().all(|c| c.is_ascii_digit() || c == '.')
                && p.matches('.').count() <= 1
                && !decimal.is_empty()
                && !p.ends_with('.')
                && p.parse::<f64>().is_ok_and(|v| v > 0.0);
            if !ok {
                out.push(Violation::new(
                    field("spotOptions.maxPrice"),
                    format!("{p:?} is not a positive price in USD per hour such as \"0.05\""),
                ));
            }
        }
        if let Some(t) = o.spot_instance_type.as_deref().filter(|t| *t != "one-time") {
            out.push(Violation::new(
                field("spotOptions.spotInstanceType"),
                format!("{t:?} is not supported: only \"one-time\" (a persistent request relaunches instances behind the controller's back)"),
            ));
        }
        if let Some(b) = o.instance_interruption_behavior.as_deref().filter(|b| *b != "terminate") {
            out.push(Violation::new(
                field("spotOptions.instanceInterruptionBehavior"),
                format!("{b:?} is not supported: a one-time spot request only terminates (the controller replaces the machine)"),
            ));
        }
        out
    }

    /// RunInstances' `InstanceMarketOptions`.
    fn to_request(&self) -> InstanceMarketOptionsRequest {
        let o = &self.spot_options;
        let spot = SpotMarketOptions::builder()
            .set_max_price(o.max_price.clone())
            .spot_instance_type(SpotInstanceType::from(o.spot_instance_type.as_deref().unwrap_or("one-time")))
            .instance_interruption_behavior(InstanceInterruptionBehavior::from(
                o.instance_interruption_behavior.as_deref().unwrap_or("terminate"),
            ))
            .build();
        InstanceMarketOptionsRequest::builder()
            .market_type(MarketType::from(self.market_type.as_str()))
            .spot_options(spot)
            .build()
    }
}

/// The provider-spec field an AWS error code points at, for BadRequest field violations.
pub fn field_for_code(code: &str, message: &str) -> &'static str {
    let by_code = [
        ("InvalidAMIID", "imageId"),
        ("InvalidSubnet", "subnetId"),
        ("InvalidAvailabilityZone", "availabilityZone"),
        ("InvalidGroup", "securityGroupIds"),
        ("InvalidSecurityGroup", "securityGroupIds"),
        ("InvalidKeyPair", "keyName"),
        ("InvalidLaunchTemplate", "launchTemplate"),
        ("InvalidUserData", "userData"),
        ("InvalidBlockDeviceMapping", "blockDevices"),
        ("InvalidIamInstanceProfile", "iamInstanceProfile"),
        ("InvalidInstanceType", "instanceType"),
        ("InvalidTag", "tags"),
        ("InvalidKmsKey", "blockDevices"),
        ("InvalidSpot", "instanceMarketOptions"),
        ("SpotMaxPriceTooLow", "instanceMarketOptions"),
    ];
    if let Some((_, f)) = by_code.iter().find(|(prefix, _)| code.starts_with(prefix)) {
        return f;
    }
    // Generic codes (InvalidParameterValue, InvalidParameterCombination, Unsupported, ...) name
    // the request parameter in the message only; map EC2 parameter names to spec fields.
    let lower = message.to_ascii_lowercase();
    let by_param = [
        ("instancetype", "instanceType"),
        ("instance type", "instanceType"),
        ("imageid", "imageId"),
        ("ami-", "imageId"),
        ("image", "imageId"),
        ("availabilityzone", "availabilityZone"),
        ("availability zone", "availabilityZone"),
        ("subnet", "subnetId"),
        ("securitygroup", "securityGroupIds"),
        ("security group", "securityGroupIds"),
        ("keyname", "keyName"),
        ("userdata", "userData"),
        ("blockdevice", "blockDevices"),
        ("volume", "blockDevices"),
        ("iops", "blockDevices"),
        ("launchtemplate", "launchTemplate"),
        ("launch template", "launchTemplate"),
        ("spot", "instanceMarketOptions"),
        ("marketoptions", "instanceMarketOptions"),
        ("iaminstanceprofile", "iamInstanceProfile"),
        ("tag", "tags"),
    ];
    by_param.iter().find(|(p, _)| lower.contains(p)).map_or("", |(_, f)| f)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn examples_match_the_schema_and_parse() {
        let schema = schema();
        driver_sdk::schema::ProviderSchema::compile(&schema).expect("the SDK accepts the schema at start");
        let examples = schema["examples"].as_array().unwrap();
        assert_eq!(examples.len(), 2);
        assert_ne!(examples[0], examples[1]);
        for e in examples {
            assert!(driver_sdk::schema::validate(&schema, e, "provider_spec").is_empty(), "{e}");
            ProviderSpec::parse(e).unwrap();
        }
    }

    #[test]
    fn image_or_launch_template_is_required() {
        let err = ProviderSpec::parse(&json!({"instanceType": "t3.micro"})).unwrap_err();
        assert_eq!(err.violations()[0].field, "provider_spec.imageId");
        ProviderSpec::parse(&json!({"instanceType": "t3.micro", "launchTemplate": {"name": "web"}})).unwrap();
        let err = ProviderSpec::parse(
            &json!({"instanceType": "t3.micro", "launchTemplate": {"name": "web", "id": "lt-0123456789abcdef0"}}),
        )
        .unwrap_err();
        assert_eq!(err.violations()[0].field, "provider_spec.launchTemplate");
        let err = ProviderSpec::parse(
            &json!({"instanceType": "t3.micro", "imageId": "ami-12345678", "tags": {"aws:x": "1"}}),
        )
        .unwrap_err();
        assert_eq!(err.violations()[0].field, "provider_spec.tags.aws:x");
        let err = ProviderSpec::parse(&json!({"instanceType": "t3.micro", "imageId": "ami-12345678",
            "region": "eu-west-1", "availabilityZone": "us-east-1a"}))
        .unwrap_err();
        assert_eq!(err.violations()[0].field, "provider_spec.availabilityZone");
    }

    #[test]
    fn the_zone_is_the_placement_of_the_launch() {
        let schema = schema();
        let spec = json!({"instanceType": "t3.micro", "imageId": "ami-12345678", "region": "eu-west-1",
            "availabilityZone": "eu-west-1b"});
        assert!(driver_sdk::schema::validate(&schema, &spec, "provider_spec").is_empty());
        for zone in ["us-west-2-lax-1a", "us-east-1-wl1-bos-wlz-1"] {
            let local = json!({"instanceType": "t3.micro", "imageId": "ami-12345678", "availabilityZone": zone});
            assert!(driver_sdk::schema::validate(&schema, &local, "provider_spec").is_empty(), "{zone}");
        }
        let bad = json!({"instanceType": "t3.micro", "imageId": "ami-12345678", "availabilityZone": "EU West"});
        assert!(!driver_sdk::schema::validate(&schema, &bad, "provider_spec").is_empty());
        let parsed = ProviderSpec::parse(&spec).unwrap();
        assert_eq!(parsed.availability_zone.as_deref(), Some("eu-west-1b"));
    }

    #[test]
    fn spot_market_options_are_validated_and_reach_run_instances() {
        let schema = schema();
        let spot = json!({"instanceType": "t3.micro", "imageId": "ami-12345678",
            "instanceMarketOptions": {"marketType": "spot", "spotOptions": {"maxPrice": "0.05",
                "spotInstanceType": "one-time", "instanceInterruptionBehavior": "terminate"}}});
        assert!(driver_sdk::schema::validate(&schema, &spot, "provider_spec").is_empty());
        let parsed = ProviderSpec::parse(&spot).unwrap();
        assert!(parsed.is_spot());
        let req = parsed.instance_market_options.as_ref().unwrap().to_request();
        assert_eq!(req.market_type(), Some(&MarketType::Spot));
        let o = req.spot_options().unwrap();
        assert_eq!(o.max_price(), Some("0.05"));
        assert_eq!(o.spot_instance_type(), Some(&SpotInstanceType::OneTime));
        assert_eq!(o.instance_interruption_behavior(), Some(&InstanceInterruptionBehavior::Terminate));
        // Defaults: one-time, terminate, AWS's price.
        let bare = json!({"instanceType": "t3.micro", "imageId": "ami-12345678",
            "instanceMarketOptions": {"marketType": "spot"}});
        let req = ProviderSpec::parse(&bare).unwrap().instance_market_options.unwrap().to_request();
        assert_eq!(req.spot_options().and_then(|o| o.max_price()), None);
        assert_eq!(req.spot_options().and_then(|o| o.spot_instance_type()), Some(&SpotInstanceType::OneTime));
        assert!(!ProviderSpec::parse(&spec_without_market()).unwrap().is_spot());
        // Each bad field is refused by name, by the schema and by parse alike.
        for (options, field) in [
            (json!({"marketType": "capacity-block"}), "provider_spec.instanceMarketOptions.marketType"),
            (
                json!({"marketType": "spot", "spotOptions": {"maxPrice": "cheap"}}),
                "provider_spec.instanceMarketOptions.spotOptions.maxPrice",
            ),
            (
                json!({"marketType": "spot", "spotOptions": {"maxPrice": "0"}}),
                "provider_spec.instanceMarketOptions.spotOptions.maxPrice",
            ),
            (
                json!({"marketType": "spot", "spotOptions": {"spotInstanceType": "persistent"}}),
                "provider_spec.instanceMarketOptions.spotOptions.spotInstanceType",
            ),
            (
                json!({"marketType": "spot", "spotOptions": {"instanceInterruptionBehavior": "stop"}}),
                "provider_spec.instanceMarketOptions.spotOptions.instanceInterruptionBehavior",
            ),
        ] {
            let spec = json!({"instanceType": "t3.micro", "imageId": "ami-12345678", "instanceMarketOptions": options});
            let err = ProviderSpec::parse(&spec).unwrap_err();
            assert_eq!(err.reason(), driver_sdk::reason::INVALID_PROVIDER_SPEC, "{spec}");
            assert_eq!(err.violations()[0].field, field, "{err}");
            if field.ends_with("maxPrice") && options["spotOptions"]["maxPrice"] == "0" {
                continue; // "0" matches the schema's pattern; parse refuses it
            }
            assert!(!driver_sdk::schema::validate(&schema, &spec, "provider_spec").is_empty(), "{spec}");
        }
    }

    #[test]
    fn the_user_data_secret_wins_over_the_spec_and_both_are_held_to_ec2s_limit() {
        let spec = ProviderSpec::parse(&json!({"instanceType": "t3.micro", "imageId": "ami-12345678",
            "userData": "#!/bin/sh\necho from-the-spec\n"}))
        .unwrap();
        let none = Secrets::default();
        assert_eq!(user_data(&spec, &none).unwrap(), Some("#!/bin/sh\necho from-the-spec\n"));
        let rendered: Secrets = [(USER_DATA_KEY, "#!/bin/sh\necho rendered\n")].into_iter().collect();
        assert_eq!(user_data(&spec, &rendered).unwrap(), Some("#!/bin/sh\necho rendered\n"));
        // An empty secret counts as absent, as every other secret key does.
        let empty: Secrets = [(USER_DATA_KEY, "")].into_iter().collect();
        assert_eq!(user_data(&spec, &empty).unwrap(), Some("#!/bin/sh\necho from-the-spec\n"));
        let bare = ProviderSpec::parse(&spec_without_market()).unwrap();
        assert_eq!(user_data(&bare, &none).unwrap(), None);
        // The limit is in bytes before base64: 16384 of them pass, one more does not.
        let at_limit: Secrets = [(USER_DATA_KEY, "a".repeat(MAX_USER_DATA_BYTES))].into_iter().collect();
        assert_eq!(user_data(&bare, &at_limit).unwrap().map(str::len), Some(MAX_USER_DATA_BYTES));
        // Multi-byte characters count by their bytes (the schema's maxLength counts characters).
        let wide = "é".repeat(MAX_USER_DATA_BYTES / 2 + 1);
        let from_spec = ProviderSpec { user_data: Some(wide.as_str().into()), ..bare.clone() };
        let err = user_data(&from_spec, &none).unwrap_err();
        assert_eq!(
            (err.code(), err.reason()),
            (driver_sdk::tonic::Code::InvalidArgument, reason::INVALID_PROVIDER_SPEC)
        );
        assert_eq!(err.violations()[0].field, "provider_spec.userData");
        assert!(err.message().contains("16386 bytes") && err.message().contains("16384"), "{err}");
        // Its Debug (and so the spec's) says how big it is, not what it says.
        assert!(!format!("{from_spec:?}").contains('é'), "{from_spec:?}");
        let debug = format!("{spec:?}");
        assert!(debug.contains("UserData(29 bytes)") && !debug.contains("from-the-spec"), "{debug}");
    }

    #[test]
    fn a_too_large_user_data_secret_is_refused_by_name_without_its_content() {
        let marker = "SECRET-BOOTSTRAP-TOKEN-abcdef.0123456789abcdef";
        let big = format!("#!/bin/sh\n{}", marker.repeat(400));
        assert!(big.len() > MAX_USER_DATA_BYTES);
        let secrets: Secrets = [(USER_DATA_KEY, big.as_str())].into_iter().collect();
        let spec = ProviderSpec::parse(&json!({"instanceType": "t3.micro", "imageId": "ami-12345678",
            "userData": "small"}))
        .unwrap();
        let err = user_data(&spec, &secrets).unwrap_err();
        assert_eq!(err.code(), driver_sdk::tonic::Code::InvalidArgument);
        assert_eq!(err.reason(), reason::FIELD_INVALID);
        assert_eq!(err.violations().len(), 1);
        assert_eq!(err.violations()[0].field, "secrets.userData");
        let size = big.len().to_string();
        for text in [err.message(), err.violations()[0].description.as_str()] {
            assert!(text.contains("userData") && text.contains(&size) && text.contains("16384"), "{text}");
        }
        let everything = format!("{} {:?} {:?} {:?}", err, err, err.violations(), err.causes());
        assert!(!everything.contains("SECRET-BOOTSTRAP") && !everything.contains("#!/bin/sh"), "{everything}");
        // On the wire too (with no redaction to lean on).
        let status = err.to_status(crate::DRIVER_NAME, "req-1", None);
        assert!(!format!("{status:?}").contains("SECRET-BOOTSTRAP"));
    }

    fn spec_without_market() -> Value {
        json!({"instanceType": "t3.micro", "imageId": "ami-12345678"})
    }

    #[test]
    fn error_codes_name_spec_fields() {
        assert_eq!(field_for_code("InvalidAMIID.NotFound", ""), "imageId");
        assert_eq!(field_for_code("InvalidSubnetID.NotFound", ""), "subnetId");
        assert_eq!(
            field_for_code("InvalidParameterValue", "Invalid value 'x9.huge' for InstanceType."),
            "instanceType"
        );
        assert_eq!(field_for_code("InvalidParameterValue", "something else"), "");
        assert_eq!(
            field_for_code(
                "InvalidParameterValue",
                "Value (eu-west-1b) for parameter availabilityZone is invalid. Subnet 'subnet-1' is in eu-west-1a."
            ),
            "availabilityZone"
        );
    }
}
