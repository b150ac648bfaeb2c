import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from services.common.grpc_server import ServiceServer, insecure_channel


async def test_health_follows_serving_switch_and_reflection_lists_services() -> None:
    server = ServiceServer(["pdserve.v1.Generation"])
    port = server.bind("127.0.0.1", 0)
    await server.start()
    try:
        async with insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            req = health_pb2.HealthCheckRequest(service="pdserve.v1.Generation")
            assert (await stub.Check(req)).status == health_pb2.HealthCheckResponse.NOT_SERVING
            await server.set_serving(True)
            assert (await stub.Check(req)).status == health_pb2.HealthCheckResponse.SERVING
            assert (await stub.Check(health_pb2.HealthCheckRequest())).status == health_pb2.HealthCheckResponse.SERVING

            refl = reflection_pb2_grpc.ServerReflectionStub(channel)

            async def requests():
                yield reflection_pb2.ServerReflectionRequest(list_services="")

            async for resp in refl.ServerReflectionInfo(requests()):
                names = {s.name for s in resp.list_services_response.service}
                assert "pdserve.v1.Generation" in names and "grpc.health.v1.Health" in names
                break
            try:
                await stub.Check(health_pb2.HealthCheckRequest(service="nope"))
                raise AssertionError("unknown service must be NOT_FOUND")
            except grpc.aio.AioRpcError as e:
                assert e.code() == grpc.StatusCode.NOT_FOUND
    finally:
        await server.stop(0)
