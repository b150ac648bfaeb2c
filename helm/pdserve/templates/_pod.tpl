{{/* Volumes and mounts shared by every pod: model, TLS, writable scratch dirs. */}}
{{- define "pdserve.volumes" -}}
- name: tmp
  emptyDir: {}
- name: cache
  emptyDir: {}
- name: config
  configMap:
    name: {{ include "pdserve.componentName" (dict "ctx" . "component" "config") }}
{{- if eq .Values.model.source "pvc" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ required "model.pvc.claimName is required when model.source is pvc" .Values.model.pvc.claimName }}
    readOnly: true
{{- else if eq .Values.model.source "hostPath" }}
- name: model
  hostPath:
    path: {{ required "model.hostPath.path is required when model.source is hostPath" .Values.model.hostPath.path }}
    type: Directory
{{- end }}
{{- if .Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ include "pdserve.tlsSecretName" . }}
    defaultMode: 0440
{{- end }}
{{- end }}

{{- define "pdserve.volumeMounts" -}}
- name: tmp
  mountPath: /tmp
- name: cache
  mountPath: /home/pdserve/.cache
- name: config
  mountPath: /etc/pdserve/config
  readOnly: true
{{- if has .Values.model.source (list "pvc" "hostPath") }}
- name: model
  mountPath: {{ .Values.model.path }}
  {{- if and (eq .Values.model.source "pvc") .Values.model.pvc.subPath }}
  subPath: {{ .Values.model.pvc.subPath }}
  {{- end }}
  readOnly: true
{{- end }}
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: /etc/pdserve/tls
  readOnly: true
{{- end }}
{{- end }}

{{/* Environment of every component: pod identity, OTEL_* when tracing is on. */}}
{{- define "pdserve.env" -}}
- name: POD_NAME
  valueFrom: {fieldRef: {fieldPath: metadata.name}}
- name: POD_IP
  valueFrom: {fieldRef: {fieldPath: status.podIP}}
- name: HOME
  value: /home/pdserve
- name: PYTHONUNBUFFERED
  value: "1"
{{- if .ctx.Values.tracing.enabled }}
- name: OTEL_SERVICE_NAME
  value: pdserve-{{ .component }}
- name: OTEL_TRACES_EXPORTER
  value: otlp
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ required "tracing.endpoint is required when tracing.enabled" .ctx.Values.tracing.endpoint | quote }}
- name: OTEL_EXPORTER_OTLP_PROTOCOL
  value: {{ .ctx.Values.tracing.protocol | quote }}
- name: OTEL_TRACES_SAMPLER
  value: {{ .ctx.Values.tracing.sampler | quote }}
- name: OTEL_TRACES_SAMPLER_ARG
  value: {{ .ctx.Values.tracing.samplerArg | quote }}
- name: OTEL_RESOURCE_ATTRIBUTES
  value: "k8s.pod.name=$(POD_NAME),k8s.namespace.name={{ .ctx.Release.Namespace }},pdserve.component={{ .component }}"
{{- end }}
{{- end }}

{{/* Container security context; engines add IPC_LOCK (pinned memory for RDMA registration). */}}
{{- define "pdserve.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: [ALL]
  {{- if .ipcLock }}
  add: [IPC_LOCK]
  {{- end }}
{{- end }}

{{/* Native gRPC probes against the standard health service on `port`. */}}
{{- /* The scheduler's probes without TLS: GET /health on its HTTP API port (200 while serving,
503 before start and while draining, like the gRPC health service). */ -}}
{{- define "pdserve.httpProbes" -}}
startupProbe:
  httpGet: {path: /health, port: {{ .port }}}
  periodSeconds: 5
  failureThreshold: {{ .startupFailures }}
readinessProbe:
  httpGet: {path: {{ .readyPath | default "/health" }}, port: {{ .port }}}
  periodSeconds: 5
  failureThreshold: 2
livenessProbe:
  httpGet: {path: /health, port: {{ .port }}}
  periodSeconds: 10
  timeoutSeconds: 5
  failureThreshold: 6
{{- end }}

{{- define "pdserve.grpcProbes" -}}
startupProbe:
  grpc: {port: {{ .port }}}
  periodSeconds: 5
  failureThreshold: {{ .startupFailures }}
readinessProbe:
  grpc: {port: {{ .port }}{{ with .readyService }}, service: {{ . }}{{ end }}}
  periodSeconds: 5
  failureThreshold: 2
livenessProbe:
  grpc: {port: {{ .port }}}
  periodSeconds: 10
  timeoutSeconds: 5
  failureThreshold: 6
{{- end }}
