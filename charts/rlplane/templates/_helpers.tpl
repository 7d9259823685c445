{{/* The release's full name, at most 63 characters. */}}
{{- define "rlplane.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* Labels of every object. The operator's pods are app.kubernetes.io/name=rlplane-operator,
so they never match RLJob pods (app.kubernetes.io/name=rlplane). */}}
{{- define "rlplane.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "rlplane.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: rlplane
{{- end -}}

{{- define "rlplane.selectorLabels" -}}
app.kubernetes.io/name: rlplane-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "rlplane.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "rlplane.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "rlplane.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "rlplane.workerImage" -}}
{{- printf "%s:%s" .Values.workerImage.repository (default .Chart.AppVersion .Values.workerImage.tag) -}}
{{- end -}}

{{/* Checks across values that the schema cannot express with a clear message. */}}
{{- define "rlplane.validate" -}}
{{- if and (gt (int .Values.replicaCount) 1) (not .Values.leaderElection.enabled) -}}
{{- fail (printf "replicaCount is %d but leaderElection.enabled is false: several replicas would reconcile the same RLJobs at once; set leaderElection.enabled=true or replicaCount=1" (int .Values.replicaCount)) -}}
{{- end -}}
{{- if and .Values.podMonitor.enabled (not .Values.podMonitor.interval) -}}
{{- fail "podMonitor.interval is empty; set it to a Prometheus duration such as 15s" -}}
{{- end -}}
{{- end -}}
