{{/* The release's full name: the release name, or release-chart when it lacks the chart's name. */}}
{{- define "machine-controller.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "machine-controller.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Selector labels: stable across upgrades. */}}
{{- define "machine-controller.selectorLabels" -}}
app.kubernetes.io/name: {{ include "machine-controller.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "machine-controller.labels" -}}
{{ include "machine-controller.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "machine-controller.serviceAccountName" -}}
{{- default (include "machine-controller.fullname" .) .Values.serviceAccount.name -}}
{{- end -}}

{{/* The socket both containers share. */}}
{{- define "machine-controller.socket" -}}
unix:///run/machine-driver/driver.sock
{{- end -}}
