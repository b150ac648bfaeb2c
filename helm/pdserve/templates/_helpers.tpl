{{/* Names: <release>-<chart>, truncated to 63 characters (DNS label). */}}
{{- define "pdserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "pdserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* <fullname>-<component>; call with (dict "ctx" $ "component" "scheduler"). */}}
{{- define "pdserve.componentName" -}}
{{- printf "%s-%s" (include "pdserve.fullname" .ctx | trunc 50 | trimSuffix "-") .component }}
{{- end }}

{{- define "pdserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "pdserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "pdserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: pdserve
{{- end }}

{{/* Labels of one component; call with (dict "ctx" $ "component" "prefill"). */}}
{{- define "pdserve.componentLabels" -}}
{{ include "pdserve.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "pdserve.componentSelector" -}}
{{ include "pdserve.selectorLabels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* Selects the pods of both engine roles (a matchExpressions selector body). */}}
{{- define "pdserve.engineSelector" -}}
matchLabels:
  {{- include "pdserve.selectorLabels" . | nindent 2 }}
matchExpressions:
  - key: app.kubernetes.io/component
    operator: In
    values: [prefill, decode]
{{- end }}

{{- define "pdserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.enabled }}
{{- default (include "pdserve.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "pdserve.image" -}}
{{- $tag := .Values.image.tag | default (printf "%s%s" .Chart.AppVersion (ternary "" "-cpu" .Values.gpu.enabled)) }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}

{{/* An engine role's image (dict "ctx" $ "role" name): the default tag gains -vllm when the
role runs vLLM engines (an image built with `--build-arg VLLM=1`); an explicit image.tag is
used as given. */}}
{{- define "pdserve.engineImage" -}}
{{- $v := index .ctx.Values .role }}
{{- if and (eq $v.engine "vllm") (not .ctx.Values.image.tag) }}
{{- printf "%s-vllm" (include "pdserve.image" .ctx) }}
{{- else }}
{{- include "pdserve.image" .ctx }}
{{- end }}
{{- end }}

{{/* The model directory every component is given ("" selects the built-in demo model). */}}
{{- define "pdserve.modelPath" -}}
{{- if eq .Values.model.source "demo" }}{{ "" }}{{ else }}{{ .Values.model.path }}{{ end }}
{{- end }}

{{/* Settings every component shares, declared once in values (model, block size, hash seed). */}}
{{- define "pdserve.sharedConfig" -}}
model: {{ include "pdserve.modelPath" . | quote }}
block_size: {{ .Values.kv.blockSize }}
hash_seed: {{ .Values.kv.hashSeed | quote }}
log_level: {{ .Values.logLevel | quote }}
{{- end }}

{{/* Refuses a component's extra config that repeats a shared or chart-managed key. */}}
{{- define "pdserve.checkExtraConfig" -}}
{{- range $key := .reserved }}
{{- if hasKey $.config $key }}
{{- fail (printf "%s.config.%s is set by the chart (declare it once in the chart values instead)" $.component $key) }}
{{- end }}
{{- end }}
{{- end }}
