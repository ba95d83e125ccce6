# Placeholder until the deployment issue: the image for the control plane and Ray nodes.
# It installs the package on the CPU torch build; `docker run IMAGE hpservice demo` runs the DTensor demo.
FROM python:3.11-slim
RUN useradd --create-home hpservice
WORKDIR /app
COPY . /app
RUN scripts/setup
USER hpservice
CMD ["hpservice", "demo"]
