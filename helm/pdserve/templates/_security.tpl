{{/* Transport security and client auth (services/common/security.py). */}}

{{/* The Secret holding tls.crt, tls.key and ca.crt. */}}
{{- define "pdserve.tlsSecretName" -}}
{{- if .Values.tls.secretName }}{{ .Values.tls.secretName }}
{{- else if .Values.tls.certManager.enabled }}{{ include "pdserve.componentName" (dict "ctx" . "component" "tls") }}
{{- else }}{{ required "tls.secretName is required when tls.enabled (or enable tls.certManager)" "" }}
{{- end }}
{{- end }}

{{/* Config keys every component gets: mTLS from the mounted Secret, or the explicit plaintext opt-in. */}}
{{- define "pdserve.securityConfig" -}}
{{- if .Values.tls.enabled }}
tls_cert: /etc/pdserve/tls/tls.crt
tls_key: /etc/pdserve/tls/tls.key
tls_ca: /etc/pdserve/tls/ca.crt
tls_server_name: {{ include "pdserve.componentName" (dict "ctx" . "component" "scheduler") }}
tls_peer_name: {{ include "pdserve.componentName" (dict "ctx" . "component" "scheduler") }}
health_port: {{ .Values.tls.healthPort }}
{{- else }}
allow_plaintext: true
{{- end }}
{{- end }}

{{/* Scheduler-only keys: client certificates on the public ports, the token file. */}}
{{- define "pdserve.schedulerSecurityConfig" -}}
{{- if and .Values.tls.enabled .Values.tls.clientCerts.enabled }}
tls_require_client_cert: true
{{- end }}
{{- if .Values.auth.enabled }}
auth_tokens_file: /etc/pdserve/auth/{{ .Values.auth.secretKey }}
{{- end }}
{{- end }}

{{/* Keys the chart manages (a component's `config` may not set them). */}}
{{- define "pdserve.securityKeys" -}}
tls_cert tls_key tls_ca tls_server_name tls_peer_name health_port allow_plaintext tls_require_client_cert auth_tokens_file auth_tokens
{{- end }}

{{/* The port the kubelet's gRPC probes use: the plaintext health port under TLS. */}}
{{- define "pdserve.probePort" -}}
{{- if .ctx.Values.tls.enabled }}{{ .ctx.Values.tls.healthPort }}{{ else }}{{ .port }}{{ end }}
{{- end }}
